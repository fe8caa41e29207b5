"""Checkpoints with orbax ``CheckpointManager``: periodic, keep-N, atomic, exact resume.

One checkpoint step directory holds three items:

- ``state``: the :class:`~confu_jax.train.state.TrainState` (trainable params, optimizer state,
  step, raw RNG key), written asynchronously by every process for its own shards;
- ``data``: each process's data-iterator state as ``process_{i}-of-{n}.json`` (every host reads a
  different shard, so every host has its own position; grain's handler does the same, but it
  insists on grain iterators and restarts prefetch — this one stores any JSON-able dict or bytes);
- ``extras``: non-trainable arrays the run depends on (the draft vocabulary d2t / t2d), if any.

Atomicity comes from orbax: items are written into a temporary directory that is renamed only
after every item of every process is complete, so a SIGKILL mid-write leaves the previous
checkpoint as the latest one; leftovers are cleaned when the manager opens the directory again.

``init_params_from`` implements "initialise ConFu from a trained EAGLE-3 checkpoint": it copies
the params present in both trees (same path, same shape) and reports the rest.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy
from jax.experimental import multihost_utils
from etils import epath

from confu_jax import storage
from confu_jax.runs.quiet_logs import quiet_read_only_warning
from confu_jax.runs.head_release import is_head_release, verify_head_release
from confu_jax.runs.trainable_export import is_trainable_export, load_trainable_export
from confu_jax.sharding import path_str
from confu_jax.weights.eagle3_formats import detect_format, head_settings_diff, load_head

_BYTES_KEY = "__bytes_b64__"


# ----------------------------------------------------------------------------- data-state item


class DataStateHandler(ocp.CheckpointHandler):
    """Per-process JSON files for data-iterator states (JSON-able dict, or bytes)."""

    def _file(self, directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory: epath.Path, args: "DataStateSave"):
        state = args.state
        if isinstance(state, (bytes, bytearray)):
            state = {_BYTES_KEY: base64.b64encode(bytes(state)).decode("ascii")}
        try:
            text = json.dumps(state, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"data iterator state must be a JSON-able dict or bytes: {e}") from e
        self._file(directory).write_text(text)

    def restore(self, directory: epath.Path, args: Optional["DataStateRestore"] = None):
        f = self._file(directory)
        if not f.exists():
            found = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            raise FileNotFoundError(
                f"no data-iterator state {f.name} in {directory} (found {found}); the checkpoint "
                f"was written by a different number of processes than {jax.process_count()}")
        state = json.loads(f.read_text())
        if isinstance(state, dict) and set(state) == {_BYTES_KEY}:
            return base64.b64decode(state[_BYTES_KEY])
        return state

    def metadata(self, directory):
        return None

    def structure(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


# ----------------------------------------------------------------------------- manager


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: Any
    extras: dict


def restore_args_for(abstract_tree):
    """RestoreArgs restoring each leaf straight into its target sharding (no host gather)."""
    return jax.tree_util.tree_map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)
        if getattr(a, "sharding", None) is not None else ocp.RestoreArgs(restore_type=np.ndarray),
        abstract_tree)


def restore_params(directory: str, abstract_params, step: Optional[int] = None) -> tuple[Any, int]:
    """(host params, step): the ``state.params`` subtree ``abstract_params`` (ShapeDtypeStructs)
    of a run's checkpoint — the latest, or ``step`` — restored alone (partial restore: optimizer
    state and data state stay on disk). What decode needs of a run whose trainable tree it knows
    from the run's config (Medusa heads, an SD² drafter's delta and steering)."""
    abstract = {"params": abstract_params}
    ckpt = Checkpointer(directory, read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"{directory} has no checkpoint for step {step}; it has {steps}")
        out = ckpt.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args_for(abstract),
                                         partial_restore=True)))
    finally:
        ckpt.close()
    return jax.tree_util.tree_map(np.asarray, out["state"]["params"]), step


def save_head_checkpoint(workdir: str, step: int, params, d2t, t2d) -> None:
    """``workdir/checkpoints/<step>`` as ``launch.train`` lays it out for a head — the params, the draft
    vocabulary as extras, an empty data state — for weights that came from elsewhere (an export
    rebuilt into a run folder): what ``runs.heads.load_trained_head`` reads."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=0, keep=0, async_save=False)
    try:
        ckpt.save(int(step), {"params": params}, {}, extras={"draft_vocab_d2t": d2t, "draft_vocab_t2d": t2d},
                  force=True)
        ckpt.wait()
    finally:
        ckpt.close()


class Checkpointer:
    """Thin policy layer over ``ocp.CheckpointManager`` for training runs."""

    def __init__(self, directory: str, every: int = 500, keep: int = 3, async_save: bool = True,
                 read_only: bool = False, milestones: Sequence[int] = (), every_seconds: float = 0):
        """``every``: save period in steps (<= 0: only forced saves); ``keep``: the newest
        checkpoints kept (<= 0: all); ``milestones``: steps that are always saved and never pruned
        (the points of a scaling curve, evaluated long after the run moved on); ``every_seconds``
        (> 0): also save once that long passed since this run's last save (or its start), as
        process 0's clock says — every process asks at every step and gets process 0's answer, so
        all save the same step (``save``)."""
        self.directory = epath.Path(storage.absolute(directory))  # epath's absolute() mangles gs://
        self.every = int(every) if every and every > 0 else 0
        self.every_seconds = float(every_seconds) if every_seconds and every_seconds > 0 else 0.0
        self._last_save = time.monotonic()
        self.milestones = frozenset(int(m) for m in milestones)
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                                   save_interval_steps=0)
            quiet_read_only_warning()  # read-only is what was asked for
        else:
            # The save policy is ours (save(): every N steps, or forced); orbax's own would also
            # save the very first step of a run and react to preemption behind the loop's back.
            keep_n = int(keep) if keep and keep > 0 else None
            pruning = dict(max_to_keep=keep_n)
            if self.milestones and keep_n is not None:  # the newest ``keep`` plus every milestone
                pruning = dict(preservation_policy=preservation_policy.AnyPreservationPolicy([
                    preservation_policy.LatestN(keep_n),
                    preservation_policy.CustomSteps(sorted(self.milestones))]))
            options = ocp.CheckpointManagerOptions(
                save_interval_steps=1,
                enable_async_checkpointing=bool(async_save),
                cleanup_tmp_directories=True,
                **pruning,
            )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": DataStateHandler(),
                           "extras": ocp.PyTreeCheckpointHandler()})
        # orbax removes unfinished temporary directories in the background; finish that before
        # this run writes its own (a resumed run re-saves the step whose write was killed).
        cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
        if cleanup is not None:
            cleanup.result()

    # -- queries
    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # -- save
    def save(self, step: int, state, data_state: Any, extras: Optional[dict] = None,
             force: bool = False) -> bool:
        """Save if ``step`` is a multiple of ``every``, a milestone, ``every_seconds`` passed since the
        last save, or ``force`` (preemption, end of run). Called by every process at every step."""
        periodic = self.every > 0 and step % self.every == 0
        if not (force or periodic or step in self.milestones or self._time_due()):
            return False
        self._last_save = time.monotonic()
        items = {"state": ocp.args.PyTreeSave(state), "data": DataStateSave(data_state)}
        if extras:
            items["extras"] = ocp.args.PyTreeSave({k: np.asarray(v) for k, v in extras.items()})
        return self.manager.save(int(step), args=ocp.args.Composite(**items), force=True)

    def _time_due(self) -> bool:
        """``every_seconds`` passed since the last save, by process 0's clock (broadcast: hosts' clocks
        and step times differ, and a save is a collective, so all must decide alike). Not orbax's
        ``CheckpointManager.should_save`` with its time policy: that also polls JAX's preemption sync
        point, which the train loop owns (one call per step)."""
        if not self.every_seconds:
            return False
        due = time.monotonic() - self._last_save >= self.every_seconds
        if jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()

    # -- restore
    def restore(self, abstract_state, step: Optional[int] = None,
                extras_like: Optional[dict] = None) -> Restored:
        """Restore ``step`` (default latest) into the shardings carried by ``abstract_state``."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        items = {
            "state": ocp.args.PyTreeRestore(item=abstract_state,
                                            restore_args=restore_args_for(abstract_state)),
            "data": DataStateRestore(),
        }
        if extras_like:
            items["extras"] = ocp.args.PyTreeRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        extras = dict(out["extras"]) if extras_like else {}
        return Restored(step=step, state=out["state"], data_state=out["data"], extras=extras)


# ----------------------------------------------------------------------------- init_from


@dataclasses.dataclass
class InitReport:
    source: str
    step: int
    copied: list  # paths copied from the source
    kept_init: list  # paths only in the new tree: fresh init
    shape_mismatch: list  # (path, source shape, new shape): fresh init
    ignored: list  # paths only in the source
    # draft LM head columns moved to the new run's draft-id order when the two runs' draft
    # vocabularies differ: {'matched': ids found in the source vocab, 'fresh': ids left at init}
    lm_head_remap: Optional[dict] = None

    def summary(self) -> str:
        lines = [f"init_from {self.source} (step {self.step}): copied {len(self.copied)} params, "
                 f"kept fresh init for {len(self.kept_init) + len(self.shape_mismatch)}, "
                 f"ignored {len(self.ignored)} source-only params"]
        lines += [f"  fresh: {p}" for p in self.kept_init]
        lines += [f"  fresh (shape {s} in source, {n} here): {p}" for p, s, n in self.shape_mismatch]
        lines += [f"  ignored: {p}" for p in self.ignored]
        if self.lm_head_remap:
            lines.append(f"  {LM_HEAD}: draft vocabularies differ; columns remapped by target id "
                         f"({self.lm_head_remap['matched']} matched, {self.lm_head_remap['fresh']} fresh)")
        return "\n".join(lines)


def _flat(tree) -> dict:
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        parts = path.split("/")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = leaf
    return out


LM_HEAD = "draft/lm_head/kernel"  # [d, V_draft]: column i scores draft id i


def _source_d2t(ckpt: Checkpointer, step: int, directory: str) -> np.ndarray:
    out = ckpt.manager.restore(step, args=ocp.args.Composite(extras=ocp.args.PyTreeRestore()))
    extras = dict(out["extras"] or {})
    if "draft_vocab_d2t" not in extras:
        raise KeyError(f"init_from: {directory} step {step} saved no draft vocabulary (extras: {sorted(extras)}), "
                       "so its draft LM head cannot be matched to this run's draft ids")
    return np.asarray(extras["draft_vocab_d2t"], np.int64)


def _remap_lm_head(src_kernel: np.ndarray, src_d2t: np.ndarray, dst_d2t: np.ndarray, init_kernel: np.ndarray):
    """Columns of a [d, V_src] draft LM head reordered to the draft ids of ``dst_d2t``: a draft id
    whose target id the source vocab also has takes that column, the rest keep ``init_kernel``'s.
    -> (kernel [d, V_dst], matched count)."""
    col_of = {int(t): j for j, t in enumerate(src_d2t)}
    src_cols = np.array([col_of.get(int(t), -1) for t in dst_d2t])
    out = np.array(init_kernel, copy=True)
    have = src_cols >= 0
    out[:, have] = np.asarray(src_kernel)[:, src_cols[have]].astype(out.dtype)
    return out, int(have.sum())


def init_params_from(directory: str, params, step: int = -1,
                     draft_vocab_d2t: Optional[np.ndarray] = None,
                     model_spec=None) -> tuple[Any, InitReport]:
    """Copy the params of another run's checkpoint into ``params`` where paths and shapes agree.

    ``params`` is the freshly initialised (sharded) trainable tree; copied leaves are restored
    directly into the sharding of the leaf they replace. Params are matched by their '/'-joined
    dict path (e.g. 'draft/fc/kernel'), which is what a ConFu tree and an EAGLE-3 tree share.
    With ``draft_vocab_d2t`` (this run's draft vocabulary), the draft LM head is matched by
    target id, not by column: if the source run's vocabulary differs, its columns are remapped
    (draft ids the source lacks keep their fresh init) instead of being copied onto other tokens.

    ``directory``: a checkpoint directory (``<workdir>/checkpoints``) or the ``launch.train`` workdir
    holding it. It may also be an EAGLE-3 head in the official (SGLang / SpecForge) or speculators
    (vLLM) format (``weights.eagle3_formats``): the paper initialises ConFu from a published
    EAGLE-3 head. ``model_spec`` (this run's ``ModelSpec``) is then checked against the head's
    RoPE and norm settings, which change what the copied weights compute. Or a trainable-tree export
    (``runs.trainable_export``: the ConFu release, a GPU campaign's ConFu head), hash-checked when
    it is a release; ``step`` is then the export's own.
    """
    if is_head_release(directory):  # a release is hash-checked on every path that reads it
        verify_head_release(directory)
    if detect_format(directory) is not None:
        return _init_from_head(directory, params, draft_vocab_d2t, model_spec)
    if is_trainable_export(directory):
        return _init_from_trainable_export(directory, params, draft_vocab_d2t)
    if storage.isdir(os.path.join(directory, "checkpoints")) and storage.isfile(os.path.join(directory, "config.json")):
        directory = os.path.join(directory, "checkpoints")  # a launch.train workdir: its checkpoints
    ckpt = Checkpointer(directory, read_only=True)
    try:
        src_step = ckpt.latest_step() if step is None or step < 0 else int(step)
        if src_step is None:
            raise FileNotFoundError(f"init_from: no checkpoint in {directory}")
        meta = ckpt.manager.item_metadata(src_step)["state"]
        meta_tree = getattr(meta, "tree", meta)
        if "params" not in meta_tree:
            raise KeyError(f"init_from: checkpoint {directory} step {src_step} has no 'params' "
                           f"in its state item (found {sorted(meta_tree)})")
        src = _flat(meta_tree["params"])
        dst = _flat(params)
        remap = None
        if draft_vocab_d2t is not None and LM_HEAD in src and LM_HEAD in dst:
            src_d2t = _source_d2t(ckpt, src_step, directory)
            if not np.array_equal(src_d2t, np.asarray(draft_vocab_d2t)):
                remap = src_d2t
        copy, mismatch = {}, []
        for p, leaf in dst.items():
            if p in src and not (remap is not None and p == LM_HEAD):
                if tuple(src[p].shape) == tuple(leaf.shape):
                    copy[p] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
                else:
                    mismatch.append((p, tuple(src[p].shape), tuple(leaf.shape)))
        if remap is not None:  # restored to host as it is, remapped below
            copy[LM_HEAD] = jax.ShapeDtypeStruct(tuple(src[LM_HEAD].shape), dst[LM_HEAD].dtype)
        report = InitReport(source=str(directory), step=src_step, copied=sorted(copy),
                            kept_init=sorted(p for p in dst if p not in src),
                            shape_mismatch=mismatch, ignored=sorted(p for p in src if p not in dst))
        if not copy:
            return params, report
        target = {"params": _nest(copy)}
        restored = ckpt.manager.restore(src_step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args_for(target),
                                         partial_restore=True)))["state"]["params"]
        got = _flat(restored)
        if remap is not None:
            leaf = dst[LM_HEAD]
            init = (jax.device_get(leaf) if leaf.is_fully_addressable  # multi-host: gather the shards
                    else multihost_utils.process_allgather(leaf, tiled=True))
            kernel, matched = _remap_lm_head(got[LM_HEAD], remap, np.asarray(draft_vocab_d2t), np.asarray(init))
            got[LM_HEAD] = jax.device_put(kernel, leaf.sharding)
            report.lm_head_remap = {"matched": matched, "fresh": int(kernel.shape[1]) - matched}
        merged = {p: got.get(p, leaf) for p, leaf in dst.items()}
        leaves = [merged[path_str(p)] for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves), report
    finally:
        ckpt.close()


def _init_from_head(directory: str, params, draft_vocab_d2t, model_spec) -> tuple[Any, InitReport]:
    """``init_params_from`` for an EAGLE-3 head on disk (official or speculators format): same
    path-and-shape rule, the LM head remapped by target id when the draft vocabularies differ."""
    imp = load_head(directory)
    if model_spec is not None:
        bad = [(f"draft.{k}", a, b) for k, a, b in head_settings_diff(imp.head, model_spec)]
        if bad:
            lines = "; ".join(f"{k}: head has {a!r}, this run {b!r}" for k, a, b in bad)
            raise ValueError(f"init_from {directory}: the run's draft settings differ from the head's, so the "
                             f"copied weights would compute something else: {lines}. Set those config keys "
                             "to the head's values")
    return _copy_host_leaves(directory, 0, {f"draft/{k}": v for k, v in _flat(imp.draft).items()}, imp.d2t,
                             params, draft_vocab_d2t)


def _init_from_trainable_export(directory: str, params, draft_vocab_d2t) -> tuple[Any, InitReport]:
    """``init_params_from`` for a trainable-tree export (``runs.trainable_export``: a ConFu release or a
    GPU campaign's ConFu head); a release was hash-checked by ``init_params_from``."""
    head = load_trainable_export(directory)
    return _copy_host_leaves(directory, head.step, _flat(head.trainable), head.draft_vocab["d2t"], params,
                             draft_vocab_d2t)


def _copy_host_leaves(directory: str, step: int, src: dict, src_d2t, params, draft_vocab_d2t) -> tuple[Any, InitReport]:
    """The path-and-shape rule on a source already in host memory ({'/'-joined path: array}), the draft
    LM head remapped by target id when the draft vocabularies differ."""
    dst = _flat(params)
    copy, mismatch = {}, []
    for p, leaf in dst.items():
        if p in src:
            if tuple(src[p].shape) == tuple(leaf.shape):
                copy[p] = src[p]
            else:
                mismatch.append((p, tuple(src[p].shape), tuple(leaf.shape)))
    report = InitReport(source=str(directory), step=int(step), copied=sorted(copy),
                        kept_init=sorted(p for p in dst if p not in src), shape_mismatch=mismatch,
                        ignored=sorted(p for p in src if p not in dst))
    if (draft_vocab_d2t is not None and LM_HEAD in dst and LM_HEAD in src
            and not np.array_equal(src_d2t, np.asarray(draft_vocab_d2t))):
        leaf = dst[LM_HEAD]
        init = (jax.device_get(leaf) if leaf.is_fully_addressable
                else multihost_utils.process_allgather(leaf, tiled=True))
        kernel, matched = _remap_lm_head(src[LM_HEAD], src_d2t, np.asarray(draft_vocab_d2t), np.asarray(init))
        copy[LM_HEAD] = kernel
        report.copied = sorted(copy)
        report.shape_mismatch = [m for m in mismatch if m[0] != LM_HEAD]
        report.lm_head_remap = {"matched": matched, "fresh": int(kernel.shape[1]) - matched}
    merged = {p: (jax.device_put(np.asarray(copy[p]).astype(leaf.dtype), leaf.sharding)
                  if p in copy and hasattr(leaf, "sharding") else copy.get(p, leaf))
              for p, leaf in dst.items()}
    leaves = [merged[path_str(p)] for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves), report
