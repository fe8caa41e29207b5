"""Train a draft head: ``python -m launch.train --config configs/<name>.py --workdir runs/x``.

Any config field can be overridden on the command line (``--config.train.optim.lr=3e-4``,
``--config.train.mesh.fsdp=4``); the config is locked, so a misspelt key or a value of the wrong
type stops the launch with an error naming the key. Re-running with the same ``--workdir``
resumes from its latest checkpoint.

Multi-process: pass ``--coordinator_address/--num_processes/--process_id`` (or set
``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``); where JAX's own cluster
detection finds the run — a SLURM job step (``srun``, one task per node), a Cloud TPU VM pod (its
metadata server), a GKE TPU pod, Open MPI — the processes find each other on their own
(``confu_jax/train/distributed.py``). See launch/*.sh, docs/training.md and docs/scale.md.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file with get_config(), e.g. configs/smollm2_confu.py[:param].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: checkpoints/, metrics.csv, eval.csv, config.json. "
    "An existing run directory is resumed from its latest checkpoint.")
_COORD = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for a multi-process run "
    "(default: JAX_COORDINATOR_ADDRESS, else the cluster JAX detects: SLURM, TPU pod, MPI; else "
    "single process).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (default: env / detected).")
_PID = flags.DEFINE_integer("process_id", None, "This process's index (default: env / detected).")
_LOCAL_IDS = flags.DEFINE_list(
    "local_device_ids", None, "Accelerator ids this process drives (default: JAX_LOCAL_DEVICE_IDS, "
    "else every device of the host: one process per host). Needed for several processes on one "
    "host, e.g. one task per GPU under SLURM: --local_device_ids=$SLURM_LOCALID.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Expose N CPU devices in this process (jax_num_cpu_devices); for "
    "development and tests of sharded / multi-process runs on a CPU machine. 0 = JAX default.")
_CPU_COLLECTIVES = flags.DEFINE_enum(
    "cpu_collectives", "gloo", ["gloo", "mpi", "none"],
    "Cross-process collectives for CPU devices (multi-process CPU runs need gloo or mpi).")
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "Build the task and its first batch, compile the train step, print what "
    "one device would hold (XLA's buffer assignment: arguments, temporaries, outputs) as JSON and "
    "write it to <workdir>/train_step_memory.json; no training. Plans a batch size for a device "
    "on any machine: a CPU compile of the GPU shapes overestimates rather than underestimates.")
_TIME_STEPS = flags.DEFINE_integer(
    "time_steps", 0, "With --compile_only: also run this many train steps (after one untimed) and report "
    "their median time, tokens/s, MFU and the device's peak memory; an abstract target "
    "(--config.model.source=abstract) is filled with random values on the devices first.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "With --compile_only: compile for this hardware instead of this host's devices, with "
    "its own compiler, from any machine: a TPU topology as JAX names it (v5p:2x2x2, v5e:2x4, v6e:2x2, "
    "v4:2x2x1) or h100:N / h200:N (N GPUs of one node). config.train.mesh lays the step over its devices; "
    "the report says whether XLA's per-device peak fits the device's memory (docs/scale.md).")
_OUT = flags.DEFINE_string(
    "out", None, "With --compile_only: write the report (JSON: platform, device_kind, devices, "
    "per_device_peak_bytes, device_memory_bytes, fits, ...) here and print one line on stdout instead "
    "of the JSON. Local path or gs://.")
_EVAL_ONLY = flags.DEFINE_bool(
    "eval_only", False, "Evaluate on the held-out batches without training: the workdir's latest "
    "checkpoint, else --config.train.checkpoint.init_from (a run, a release, an EAGLE-3 export); "
    "prints the metrics as JSON and writes <workdir>/eval_only.json.")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 300, "Seconds to wait for all processes to join (and, on a TPU pod, for "
    "the coordinator's host name to resolve); past it the launch stops naming the coordinator.")


def fit_line(program: str, r: dict) -> str:
    """One stdout line for a compiled program: where, the per-device peak against the device, fits."""
    gib = lambda b: "?" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    fits = {True: "fits", False: "DOES NOT FIT", None: "fit unknown (device memory not in the table)"}[r["fits"]]
    return (f"{program}: {r.get('topology') or r['platform']} ({r['devices']} x {r['device_kind']}, mesh "
            f"{r['mesh']}): per-device peak {gib(r['per_device_peak_bytes'])} of {gib(r['device_memory_bytes'])}: {fits}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    try:
        config = _CONFIG.value
        if config is None:
            raise app.UsageError("--config is required, e.g. --config configs/smollm2_confu.py")
        has_train = "train" in config
    except OSError as e:  # ml_collections defers a config file's load error to first access
        raise app.UsageError(str(e)) from None
    if not has_train:
        raise app.UsageError(
            f"config {flags.FLAGS['config'].value!r} has no 'train' section; add "
            "confu_jax.train.config.default_train_config() as config.train")
    if not _WORKDIR.value and not _COMPILE_ONLY.value:
        raise app.UsageError("--workdir is required (checkpoints and metrics go there)")
    if (_TOPOLOGY.value or _OUT.value) and not _COMPILE_ONLY.value:
        raise app.UsageError("--topology and --out go with --compile_only (a topology's devices compile, "
                             "they do not run)")
    if _TOPOLOGY.value and _TIME_STEPS.value:
        raise app.UsageError("--time_steps runs the step on attached devices; drop it with --topology")
    if _TOPOLOGY.value:
        from confu_jax.topology import cpu_host

        cpu_host()  # this process computes nothing: keep JAX off any accelerator plugin

    # orbax logs every save phase at INFO; keep its warnings, drop its chatter.
    from confu_jax.runs.quiet_logs import quiet_orbax_logs

    quiet_orbax_logs()
    import logging as pylog

    pylog.getLogger("jax._src.xla_bridge").setLevel(pylog.WARNING)  # "no TPU backend" noise

    # Order matters: CPU device count and collectives must be set before JAX starts a backend,
    # and jax.distributed.initialize must run before the first device query.
    from confu_jax.train import distributed

    distributed.configure_cpu(_CPU_DEVICES.value,
                              None if _CPU_COLLECTIVES.value == "none" else _CPU_COLLECTIVES.value)
    spec = distributed.resolve(_COORD.value, _NPROC.value, _PID.value, _LOCAL_IDS.value or None,
                               initialization_timeout=_INIT_TIMEOUT.value)
    distributed.initialize(spec, initialization_timeout=_INIT_TIMEOUT.value, prog="launch.train")

    import jax

    from confu_jax import storage
    from confu_jax.train.loop import compile_report, describe_memory, evaluate_only, train

    logging.info("process %d/%d (%s), %d local / %d global devices", jax.process_index(),
                 jax.process_count(), spec.describe(), jax.local_device_count(), jax.device_count())
    from confu_jax.train.task import resolve_run_config
    from confu_jax.user_errors import USER_ERRORS

    topo = mesh = None
    try:  # the user's checkpoint, preset and batch, checked before anything is built: one line each
        if _TOPOLOGY.value:
            from confu_jax import sharding as shd
            from confu_jax.topology import get_topology

            topo = get_topology(_TOPOLOGY.value)
            m = config.train.mesh
            mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=topo.devices)
        config = resolve_run_config(config, mesh)
    except (RuntimeError, *USER_ERRORS) as e:  # CheckpointError, AssetNotFoundError, StorageError included
        sys.stderr.write(f"launch.train: {e}\n")
        sys.exit(2)
    from confu_jax.train.target_loading import is_abstract

    source = config.model.get("source", "") if "model" in config else ""
    if is_abstract(source) and not _COMPILE_ONLY.value:
        sys.stderr.write(f"launch.train: --config.model.source={source} has shapes but no weights: "
                         "it compiles the step (add --compile_only), it does not train or evaluate\n")
        sys.exit(2)
    if _COMPILE_ONLY.value:
        report = compile_report(config, mesh=mesh, time_steps=_TIME_STEPS.value, topology=topo)
        if jax.process_index() == 0:
            if report.get("compile_error"):
                logging.info("train step: the compiler refused it: %s", report["compile_error"])
            else:
                logging.info("train step %s", describe_memory(report["memory_per_device"]))
            if "timed" in report:
                logging.info("train step timed: %s", json.dumps(report["timed"]))
            text = json.dumps(report, indent=1, sort_keys=True)
            if _WORKDIR.value:
                storage.write_text(os.path.join(_WORKDIR.value, "train_step_memory.json"), text)
            if _OUT.value:
                storage.write_text(_OUT.value, text)
                print(fit_line("train_step", report))
            else:
                print(text)
        return
    if _EVAL_ONLY.value:
        result = evaluate_only(config, storage.absolute(_WORKDIR.value))
        if jax.process_index() == 0:
            print(json.dumps(result, indent=1, sort_keys=True))
        return
    result = train(config, storage.absolute(_WORKDIR.value))
    if jax.process_index() == 0:
        summary = {"step": result.step, "start_step": result.start_step,
                   "preempted": result.preempted, **{f"train/{k}": v for k, v in
                                                     result.last_metrics.items()},
                   **{f"eval/{k}": v for k, v in result.last_eval.items()}}
        print(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.train", main)
