"""The training loop: mesh → state (fresh, resumed or initialised from another run) → compiled
step → batches → metrics, checkpoints and preemption handling.

Everything about *what* is trained comes from a :class:`~confu_jax.train.task.TrainTask`; this
module is the same for the ConFu objective, the EAGLE-3 baseline and the toy task of the test suite.

Resumption is exact: the state (params, optimizer, step, RNG) and every process's data position
come back from the latest complete checkpoint, so a run killed at any point continues with the
same batches, the same random draws and therefore the same losses.

Preemption: with one process a SIGTERM handler sets a flag; with several, JAX's preemption sync
service (started by ``jax.distributed.initialize``) makes every process agree on the step at
which to stop. Either way the loop saves a checkpoint at that step and returns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from confu_jax import progress, storage
from confu_jax import sharding as shd
from confu_jax.train import distributed
from confu_jax.models.spec import model_spec_from_config
from confu_jax.runs.checkpoint import Checkpointer, init_params_from
from confu_jax.runs.heads import write_target_record
from confu_jax.runs.lock import workdir_lock
from confu_jax.train.metric_writers import RecordLog, make_writers
from confu_jax.train.optim import make_optimizer
from confu_jax.train.state import param_count, state_builder
from confu_jax.train.step import CompiledStep, make_eval_step, make_train_step
from confu_jax.train.throughput import Meter, device_peak_flops, parse_profile_steps
from confu_jax.train.task import TrainTask, resolve_run_config
from confu_jax.train.tasks import load_task
from confu_jax.weights.eagle3_formats import detect_format

Hook = Callable[[int, Any, dict], None]  # (step, state, device metrics) after each step


@dataclasses.dataclass
class RunSetup:
    """Everything about a run that does not depend on the data position."""

    config: Any
    task: TrainTask
    mesh: Any
    tx: Any
    schedule: Any
    build_state: Callable
    abstract_state: Any
    state_shardings: Any
    frozen_shardings: Any
    frozen: Any

    def init_state(self):
        """Fresh state built directly in its shardings (identical on any mesh: same seed)."""
        return jax.jit(self.build_state, out_shardings=self.state_shardings)()

    def sharded_abstract_state(self):
        return shd.with_shardings(self.abstract_state, self.state_shardings)

    def compile_train_step(self, batch, donate: bool = True) -> CompiledStep:
        return make_train_step(self.task.loss_fn, self.tx, self.mesh, state=self.abstract_state,
                               state_shardings=self.state_shardings, frozen=self.frozen,
                               frozen_shardings=self.frozen_shardings, batch=batch,
                               schedule=self.schedule, donate=donate)

    def compile_eval_step(self, batch) -> CompiledStep:
        eval_fn = self.task.eval_fn
        if eval_fn is None:
            def eval_fn(params, frozen, batch, rng):
                loss, metrics = self.task.loss_fn(params, frozen, batch, rng)
                return dict(metrics, loss=loss)
        return make_eval_step(eval_fn, self.mesh, state=self.abstract_state,
                              state_shardings=self.state_shardings, frozen=self.frozen,
                              frozen_shardings=self.frozen_shardings, batch=batch)


def describe_memory(report: Optional[dict]) -> str:
    """One log line from ``CompiledStep.memory_report``."""
    if not report:
        return "no memory analysis from this backend"
    gib = {k: v / 2**30 for k, v in report.items()}
    return ("per device: ~{peak_estimate:.2f} GiB peak (arguments {arguments:.2f}, temporaries "
            "{temp:.2f}, outputs {outputs:.2f}, donated {aliased:.2f})").format(**gib)


def compile_report(config, task: Optional[TrainTask] = None, mesh=None, time_steps: int = 0,
                   topology=None) -> dict:
    """Compile the train step for ``config`` on this process's devices and report what one device
    would hold, without training: how a batch size is planned for a device before a run. Builds the
    task and its first batch, so the data and the target must be reachable (or abstract).

    ``topology`` (a ``confu_jax.topology.Topology``): compile for that hardware instead, on a mesh of
    its compile-only devices (``config.train.mesh``'s sizes) with XLA:TPU or XLA:GPU, on any host:
    the real compiler's answer to "does it fit?" (``fits``: XLA's per-device peak against the
    device's memory). Without it, XLA of this host's backend answers for this host's devices.

    ``time_steps`` > 0: also run that many steps (after one untimed) and report their median time,
    tokens/s, MFU and the device's peak memory. An abstract target is filled with random values
    first, on the devices in its shardings (a step's cost does not depend on the values): how the
    8B training step is timed on one GPU with nothing downloaded."""
    from confu_jax.devices import compiling_for, platform_name
    from confu_jax.topology import memory_report, out_of_memory, untuned_tiling

    if topology is not None:
        if time_steps:
            raise ValueError("time_steps runs the step: it needs the devices attached, not a topology")
        if mesh is None:
            m = config.train.mesh
            mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=topology.devices)
    t0 = time.time()
    with compiling_for(topology.platform if topology is not None else None):
        run = setup_run(config, task, mesh)
        first, _ = split_record_ids(next(run.task.train_iterator(jax.process_index(), jax.process_count())))
        batch = shd.global_batch(first, run.mesh)
        t1 = time.time()
        device = next(iter(run.mesh.devices.flat))
        dev_mem = topology.device_memory_bytes if topology is not None else _host_device_memory(device)
        where = {"backend": jax.default_backend(), "platform": platform_name(device.platform),
                 "device_kind": device.device_kind, "topology": topology.name if topology is not None else None,
                 "devices": int(run.mesh.size), "mesh": dict(run.mesh.shape),
                 "batch": {k: list(v.shape) for k, v in batch.items()}, "setup_s": round(t1 - t0, 1)}
        try:
            step = run.compile_train_step(batch)
        except Exception as e:  # noqa: BLE001 - the compiler's "does not fit" is an answer, not a failure
            oom = out_of_memory(e, dev_mem) if topology is not None else None
            if oom is None:
                hint = untuned_tiling(e) if topology is not None else None
                if hint is not None:
                    raise hint from e
                raise
            return dict(where, **oom, compile_s=round(time.time() - t1, 1), memory_per_device=None)
    flops = step.matmul_flops()
    report = dict(where, memory_per_device=step.memory_report(), compile_s=round(time.time() - t1, 1),
                  matmul_flops_per_step=flops, trainable_params=param_count(run.abstract_state.params))
    report.update({k: v for k, v in memory_report(step.compiled, dev_mem).items()
                   if k in ("per_device_peak_bytes", "device_memory_bytes", "fits")})
    if time_steps > 0:
        report["timed"] = _time_steps(run, step, batch, flops, int(time_steps))
    return report


def _host_device_memory(device) -> Optional[int]:
    """An attached device's memory: what it reports (``bytes_limit``), else the table's, else None (a CPU)."""
    from confu_jax.devices import device_memory_bytes

    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory stats
        limit = None
    return int(limit) if limit else device_memory_bytes(device.device_kind)


def random_like(abstract_tree, shardings, seed: int = 0):
    """Global arrays of ``abstract_tree``'s shapes and dtypes on ``shardings``, filled with small random
    values where they live (nothing is built on the host)."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract_tree)

    def make():
        keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
        return jax.tree_util.tree_unflatten(treedef, [
            (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, x.dtype)
            for k, x in zip(keys, leaves)])

    return jax.jit(make, out_shardings=shardings)()


def _time_steps(run: RunSetup, step: CompiledStep, batch, flops: float, n: int) -> dict:
    frozen = run.frozen
    if any(not isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(frozen)):
        frozen = random_like(frozen, run.frozen_shardings)
    state = run.init_state()
    state, metrics = step.compiled(state, frozen, batch)  # untimed: first-call work
    jax.block_until_ready(metrics)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = step.compiled(state, frozen, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    med = float(np.median(times))
    tokens = int(np.prod(batch["tokens"].shape)) if "tokens" in batch else 0
    peak = device_peak_flops()
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"steps": n, "step_s_median": med, "step_s": [round(x, 4) for x in times],
            "tokens_per_s": tokens / med if med else None,
            "mfu": flops / med / (peak * jax.device_count()) if peak and med else "n/a",
            "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "device_kind": jax.devices()[0].device_kind}


def setup_run(config, task: Optional[TrainTask] = None, mesh=None) -> RunSetup:
    tc = config.train
    mesh = mesh if mesh is not None else shd.make_mesh(tc.mesh.data, tc.mesh.fsdp, tc.mesh.tensor)
    config = resolve_run_config(config, mesh)
    task = task if task is not None else load_task(config)
    tx, schedule = make_optimizer(tc.optim, tc.steps)
    build = state_builder(task.init_params, tx, int(tc.seed))
    abstract_state = jax.eval_shape(build)
    state_sh = shd.tree_shardings(abstract_state, mesh, task.param_rules, axis_units=task.axis_units)
    frozen_sh = shd.tree_shardings(task.frozen_abstract, mesh, task.param_rules,
                                   axis_units=task.axis_units)
    from confu_jax.topology import is_compile_only

    if is_compile_only(next(iter(mesh.devices.flat))):  # a topology's devices: shapes to compile against
        frozen = shd.with_shardings(task.frozen_abstract, frozen_sh)
    else:
        frozen = task.load_frozen(frozen_sh)
    return RunSetup(config, task, mesh, tx, schedule, build, abstract_state, state_sh, frozen_sh,
                    frozen)


class PreemptionWatcher:
    """Did this run receive a preemption notice (SIGTERM)? Agreed across processes."""

    def __init__(self):
        self.flag = False
        self._old = None
        self.multi = distributed.is_initialized() and jax.process_count() > 1
        if not self.multi and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.flag = True

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # preemption service disabled
                return False
        return self.flag

    def close(self):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


def _meter(run: RunSetup, batch, train_step: CompiledStep, main: bool) -> Meter:
    """The run's throughput meter: tokens per step from the batch's shape, the step's matrix-product
    FLOPs from its jaxpr (``train.throughput``), the device's peak from the table."""
    tokens = int(np.prod(batch["tokens"].shape)) if "tokens" in batch else 0
    t0 = time.time()
    try:
        flops = train_step.matmul_flops()
    except Exception as e:  # a figure for the log must never stop a run
        logging.warning("train step FLOPs not counted (%s: %s); MFU is n/a", type(e).__name__, e)
        flops = None
    if main and flops:
        logging.info("train step: %.3g matmul FLOPs (counted in %.1fs), device peak %s", flops, time.time() - t0,
                     f"{device_peak_flops():.3g} FLOP/s" if device_peak_flops() else "unknown (MFU n/a)")
    return Meter(tokens, flops, device_peak_flops(), jax.device_count())


def _host_metrics(metrics) -> dict:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def _check_extras(saved: dict, current: dict):
    for k, v in current.items():
        if k not in saved:
            raise ValueError(f"checkpoint lacks extra array {k!r} that this run uses")
        if not np.array_equal(np.asarray(saved[k]), np.asarray(v)):
            raise ValueError(f"extra array {k!r} in the checkpoint differs from the one this run "
                             f"built (e.g. the draft vocabulary was rebuilt from different data)")


@dataclasses.dataclass
class TrainResult:
    step: int
    start_step: int
    preempted: bool
    last_metrics: dict
    last_eval: dict
    init_report: Any = None


def evaluate(eval_step: CompiledStep, state, batches: Sequence) -> dict:
    """Mean of each metric over the held-out batches."""
    acc: dict = {}
    for b in batches:
        for k, v in _host_metrics(eval_step(state, b)).items():
            acc.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in acc.items()}


# Settings a resumed run may change: how long it runs, how it logs, evaluates and checkpoints, and
# how it is laid out on devices (checkpoints restore into any mesh). Everything else changes what
# is trained, so resuming a workdir with it changed is refused.
RESUMABLE_CHANGES = ("train.steps", "train.log_every", "train.eval_every", "train.milestones", "train.tensorboard",
                     "train.progress_bar", "train.profile_steps", "train.log_records", "train.checkpoint.every", "train.checkpoint.every_seconds", "train.checkpoint.keep",
                     "train.checkpoint.async_save", "train.checkpoint.init_from",
                     "train.checkpoint.init_from_step", "train.mesh.", "data.num_threads",
                     "data.prefetch_buffer_size", "data.num_workers", "objective.eval_batches", "objective.token_chunk", "objective.remat_mlp",
                     "confu.eval_lag_weights")


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, current: dict) -> dict:
    """{key: (saved value, current value)} for every setting both configs have and set differently.

    A key only one side has is a setting added or removed between versions of the code, not a
    change the user made, and is not reported."""
    a, b = _flatten(saved), _flatten(current)
    return {k: (a[k], b[k]) for k in sorted(set(a) & set(b)) if a[k] != b[k]}


def disallowed_changes(workdir: str, config) -> dict:
    """Settings that differ from the run saved in ``workdir`` and may not change on resume."""
    path = os.path.join(workdir, "config.json")
    if not storage.isfile(path):
        return {}  # a workdir without its config (older runs, or a host without the shared file system)
    with storage.open(path) as f:
        saved = json.load(f)
    current = json.loads(config.to_json_best_effort())
    return {k: v for k, v in config_changes(saved, current).items()
            if not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE_CHANGES)}


def check_resume_config(workdir: str, config) -> None:
    """Refuse to resume ``workdir`` with a config that changes what is trained (keys named)."""
    bad = disallowed_changes(workdir, config)
    path = os.path.join(workdir, "config.json")
    if bad:
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in bad.items())
        raise ValueError(f"{workdir} holds checkpoints of a run with a different config ({path}): {lines}. "
                         f"Resuming may change only {', '.join(RESUMABLE_CHANGES)}; use a new --workdir "
                         "(with train.checkpoint.init_from to start from this run) or restore those values")


def run_target_fingerprint(run: RunSetup) -> Optional[str]:
    """The frozen target's fingerprint; every process calls this (a target sharded over several
    processes is sampled under jit: a collective all of them must join)."""
    task = run.task
    return task.target_fingerprint(run.frozen) if callable(task.target_fingerprint) else task.target_fingerprint


def write_run_files(config, workdir: str, run: RunSetup, fingerprint: Optional[str]) -> None:
    """config.json, target.json, mesh.json and the run's description in the log (process 0 only)."""
    task = run.task
    storage.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
    # which process holds which mesh position
    storage.write_text(os.path.join(workdir, "mesh.json"), json.dumps(shd.mesh_layout(run.mesh), indent=1))
    if fingerprint:
        write_target_record(workdir, fingerprint, task.target_source)
    logging.info("task: %s | mesh %s over %d processes | trainable %s params | frozen %s params",
                 task.description, dict(run.mesh.shape), jax.process_count(),
                 f"{param_count(run.abstract_state.params):,}", f"{param_count(task.frozen_abstract):,}")
    for row in shd.explain(run.abstract_state.params, run.mesh, task.param_rules, axis_units=task.axis_units):
        if row["fallbacks"]:
            logging.info("sharding fallback (replicated dims) for %s %s: %s", row["path"], row["shape"],
                         row["fallbacks"])


def _restore_or_init(config, workdir: str, run: RunSetup, ckpt: Checkpointer, iterator, main: bool):
    """The latest checkpoint of this workdir (exact resume), else a fresh state, optionally
    initialised from another run (``train.checkpoint.init_from``) -> (state, start step, init report)."""
    tc, task = config.train, run.task
    latest = ckpt.latest_step()
    if latest is not None:
        r = ckpt.restore(run.sharded_abstract_state(), latest, extras_like=task.extra_arrays)
        iterator.set_state(r.data_state)
        _check_extras(r.extras, task.extra_arrays)
        if int(jax.device_get(r.state.step)) != r.step:
            raise ValueError(f"checkpoint step {r.step} holds state.step={int(r.state.step)}")
        if main:
            logging.info("resumed from %s at step %d", ckpt.directory, r.step)
        return r.state, r.step, None
    state, init_report = run.init_state(), None
    if tc.checkpoint.init_from:
        # an EAGLE-3 head in another framework's format: its RoPE / norm settings must be this run's
        model_spec = model_spec_from_config(config) if detect_format(tc.checkpoint.init_from) else None
        params, init_report = init_params_from(tc.checkpoint.init_from, state.params, tc.checkpoint.init_from_step,
                                               draft_vocab_d2t=task.extra_arrays.get("draft_vocab_d2t"),
                                               model_spec=model_spec)
        state = state.replace(params=params)
        if main:
            from confu_jax.runs.lineage import source_lineage

            logging.info("%s", init_report.summary())
            # what the source had seen, fixed now: a release may be replaced later (runs.lineage)
            record = dict(dataclasses.asdict(init_report),
                          source_lineage=source_lineage(tc.checkpoint.init_from, init_report.step))
            storage.write_text(os.path.join(workdir, "init_from.json"), json.dumps(record, indent=2))
    return state, 0, init_report


EVAL_ONLY_FILE = "eval_only.json"


def evaluate_only(config, workdir: str, task: Optional[TrainTask] = None, mesh=None) -> dict:
    """Evaluate a head on the run's held-out batches without training: the workdir's latest
    checkpoint if it has one, else ``train.checkpoint.init_from`` (a run, a release, an EAGLE-3
    export) in a fresh workdir. Returns ``{'step', 'source', 'eval': {metric: mean}}`` and writes it
    to ``<workdir>/eval_only.json``. The metrics are those training writes to eval.csv at the same
    parameters (plus, at any step, what the objective only computes in evaluation)."""
    config = resolve_run_config(config, mesh)  # before the resume check: it compares resolved values
    tc = config.train
    pidx, pcount = jax.process_index(), jax.process_count()
    main = pidx == 0
    with workdir_lock(workdir, pidx):
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=tc.checkpoint.every,
                            keep=tc.checkpoint.keep, async_save=False)
        try:
            latest = ckpt.latest_step()
            if latest is None and not tc.checkpoint.init_from:
                raise ValueError(f"evaluate_only: {workdir!r} has no checkpoint and train.checkpoint.init_from "
                                 "is empty; name the head to evaluate (a run, a release or an EAGLE-3 export)")
            if latest is not None:
                check_resume_config(workdir, config)
            run = setup_run(config, task, mesh)
            if run.task.eval_batches is None:
                raise ValueError("evaluate_only: the task has no held-out batches (objective.eval_batches = 0?)")
            if latest is None:  # a trained workdir keeps its own config.json
                fingerprint = run_target_fingerprint(run)
                if main:
                    write_run_files(config, workdir, run, fingerprint)
            iterator = run.task.train_iterator(pidx, pcount)
            state, step, _ = _restore_or_init(config, workdir, run, ckpt, iterator, main)
            eval_step, batches = _eval_setup(run, True, pidx, pcount)
            result = {"step": int(step), "source": os.path.join(workdir, "checkpoints") if latest is not None
                      else str(tc.checkpoint.init_from), "eval": evaluate(eval_step, state, batches)}
        finally:
            ckpt.close()
    if main:
        storage.write_text(os.path.join(workdir, EVAL_ONLY_FILE), json.dumps(result, indent=1, sort_keys=True))
    return result


def parse_milestones(text) -> frozenset:
    """``train.milestones`` ('8,16,32' or a sequence of ints) as a set of positive steps."""
    items = text.split(",") if isinstance(text, str) else list(text or ())
    try:
        steps = frozenset(int(str(m).strip()) for m in items if str(m).strip())
    except ValueError:
        raise ValueError(f"train.milestones: expected comma-separated step numbers such as '8,16,32', "
                         f"got {text!r}") from None
    if any(m <= 0 for m in steps):
        raise ValueError(f"train.milestones: steps must be >= 1, got {sorted(steps)}")
    return steps


def _eval_setup(run: RunSetup, enabled: bool, pidx: int, pcount: int):
    """(compiled eval step or None, this process's held-out batches on the mesh)."""
    if not enabled or run.task.eval_batches is None:
        return None, []
    batches = [shd.global_batch(split_record_ids(b)[0], run.mesh) for b in run.task.eval_batches(pidx, pcount)]
    return (run.compile_eval_step(batches[0]) if batches else None), batches


BAD_RECORDS_LOG = "bad_records.log"  # every skipped training record, file:line: reason: detail


def split_record_ids(local_batch):
    """(the batch without ``record_index``, the ids or None): which records a batch holds is host-side
    bookkeeping (``train.log_records``), never a device input — so the compiled step is the same with
    or without it, and equal to the one ``--compile_only`` sizes."""
    if not isinstance(local_batch, dict) or "record_index" not in local_batch:
        return local_batch, None
    rest = dict(local_batch)
    return rest, rest.pop("record_index")


def _log_records(log: RecordLog, step: int, ids) -> None:
    """This process's records of one step: [B] (a row each) or, packed, [B, N] per token (-1: padding)."""
    if ids is None:
        raise ValueError("train.log_records: this run's batches carry no 'record_index' (synthetic data has "
                         "none); turn train.log_records off")
    ids = np.asarray(ids)
    if ids.ndim == 2:  # packed rows: each row's records in the order they sit in it
        ids = [int(r) for row in ids for r in dict.fromkeys(row.tolist()) if r >= 0]
    log.write(step, np.asarray(ids).reshape(-1))


def train(config, workdir: str, hooks: Sequence[Hook] = (), task: Optional[TrainTask] = None,
          mesh=None) -> TrainResult:
    """Train until ``config.train.steps`` (resuming the workdir's latest checkpoint), evaluating,
    logging and checkpointing as configured; a preemption signal saves and stops cleanly.
    A second process training the same workdir is refused (``runs.lock``)."""
    with workdir_lock(workdir, jax.process_index()):
        return _train_locked(config, workdir, hooks, task, mesh)


def _train_locked(config, workdir: str, hooks: Sequence[Hook], task: Optional[TrainTask],
                  mesh) -> TrainResult:
    config = resolve_run_config(config, mesh)  # before the resume check: it compares resolved values
    tc = config.train
    pidx, pcount = jax.process_index(), jax.process_count()
    main = pidx == 0
    milestones = parse_milestones(tc.get("milestones", ""))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=tc.checkpoint.every,
                        keep=tc.checkpoint.keep, async_save=tc.checkpoint.async_save, milestones=milestones,
                        every_seconds=tc.checkpoint.get("every_seconds", 0))
    if ckpt.latest_step() is not None:
        try:
            check_resume_config(workdir, config)
        except ValueError:
            ckpt.close()
            raise
    from confu_jax.data.formats import bad_records_log_to

    with bad_records_log_to(os.path.join(workdir, BAD_RECORDS_LOG) if main else None):
        run = setup_run(config, task, mesh)
    task = run.task
    fingerprint = run_target_fingerprint(run)
    if main:
        write_run_files(config, workdir, run, fingerprint)
    iterator = task.train_iterator(pidx, pcount)
    state, start, init_report = _restore_or_init(config, workdir, run, ckpt, iterator, main)

    writers = make_writers(workdir, "metrics", tc.tensorboard, start) if main else None
    eval_writers = make_writers(workdir, "eval", tc.tensorboard, start) if main else None
    # wall-clock figures apart from metrics.csv, which stays a function of (config, data, step) only
    speed_writers = make_writers(workdir, "throughput", tc.tensorboard, start) if main else None
    records = (RecordLog(os.path.join(workdir, "records", f"process_{pidx}-of-{pcount}.csv"), start)
               if tc.get("log_records", False) else None)
    t_eval = time.time()
    eval_step, eval_batches = _eval_setup(run, tc.eval_every > 0 or bool(milestones), pidx, pcount)
    if main and eval_step is not None:  # each phase before the first step is logged: a stall names its phase
        logging.info("held-out batches and eval step ready in %.1fs", time.time() - t_eval)

    profile = parse_profile_steps(tc.get("profile_steps", ""))
    profile_dir = os.path.join(workdir, "profile")
    # the profiler writes to a local disk; a trace for a workdir on an object store is copied there after
    trace_dir = (tempfile.mkdtemp(prefix="confu_jax_profile_") if profile and storage.is_remote(workdir)
                 else profile_dir)
    tracing = False
    meter = None
    watcher = PreemptionWatcher()
    pbar = progress.bar(tc.steps, initial=start, desc="train", enabled=main and bool(tc.progress_bar))
    step, preempted, last, last_eval = start, False, {}, {}
    train_step = None
    try:
        while step < tc.steps:
            t_batch = time.time()
            local = next(iterator)
            local, ids = split_record_ids(local)
            if records is not None:
                _log_records(records, step + 1, ids)
            batch = shd.global_batch(local, run.mesh)
            if train_step is None:
                t0 = time.time()
                if main:
                    logging.info("first training batch in %.1fs; compiling the train step", t0 - t_batch)
                with progress.phase("compiling the train step", enabled=main and bool(tc.progress_bar)):
                    train_step = run.compile_train_step(batch)
                if main:
                    logging.info("compiled train step in %.1fs; %s", time.time() - t0,
                                 describe_memory(train_step.memory_report()))
                meter = _meter(run, batch, train_step, main)
            if profile and step + 1 == profile[0] and not tracing:
                jax.profiler.start_trace(trace_dir)
                tracing = True
            state, metrics = train_step(state, batch)
            step += 1
            meter.step(metrics.get("tokens/real"))
            if tracing and step >= profile[1]:
                jax.block_until_ready(metrics)
                jax.profiler.stop_trace()
                tracing = False
                if trace_dir != profile_dir:
                    storage.copy_tree(trace_dir, profile_dir)
                if main:
                    logging.info("profiler trace of steps %d-%d in %s", profile[0], profile[1], profile_dir)
            if step == start + 1:
                jax.block_until_ready(metrics)
                if main:
                    logging.info("first train step done %.1fs after its compile began", time.time() - t0)
                meter.start()  # throughput counts the steps after the compiling one
            if step % max(tc.log_every, 1) == 0 or step == tc.steps:
                last = _host_metrics(metrics)
                speed = meter.read()
                if task.rows_per_epoch:
                    last["epoch"] = step * int(config.data.global_batch_size) / task.rows_per_epoch
                if main:
                    writers.write(step, last)
                    pbar.set_postfix(loss=f"{last['loss']:.4f}", refresh=False)
                    if speed:
                        speed_writers.write(step, speed)
                        logging.info("step %d: loss %.4f; %s", step, last["loss"], meter.describe(speed))
            periodic_eval = tc.eval_every > 0 and step % tc.eval_every == 0
            if eval_step is not None and (periodic_eval or step in milestones or step == tc.steps):
                last_eval = evaluate(eval_step, state, eval_batches)
                if main:
                    eval_writers.write(step, last_eval)
            preempted = watcher.reached(step)
            ckpt.save(step, state, iterator.get_state(), task.extra_arrays,
                      force=preempted or step == tc.steps)
            for hook in hooks:
                hook(step, state, metrics)
            pbar.update(1)
            if preempted:
                if main:
                    logging.warning("preemption notice: checkpoint saved at step %d, stopping", step)
                break
    finally:
        if tracing:
            jax.profiler.stop_trace()
        pbar.close()
        watcher.close()
        ckpt.wait()
        ckpt.close()
        if main:
            writers.close()
            eval_writers.close()
            speed_writers.close()
    return TrainResult(step=step, start_step=start, preempted=preempted, last_metrics=last,
                       last_eval=last_eval, init_report=init_report)
