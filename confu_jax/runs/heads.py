"""Trained draft heads out of ``launch.train`` workdirs, for decoding, benchmarks and init_from.

This lives outside ``train`` and ``decode`` because both read it (docs/DESIGN.md §2, §8).
A workdir holds ``config.json`` (written by ``train.loop.train`` at start), ``target.json`` (the
fingerprint of the frozen target the head was trained against) and
``checkpoints/<step>/`` (orbax: ``state`` with the trainable params, ``extras`` with the draft
vocabulary d2t / t2d). Only ``state.params`` is read back (partial restore): the optimizer state
is as large again and decoding never needs it. Everything comes back as host numpy arrays; the
caller places them.

A head is only meaningful on the target it was trained for: a base and an instruct model of the
same shape would load each other's heads silently and decode losslessly but slowly. So training
records a fingerprint of the target's weights (``target_fingerprint``: a hash of a fixed sample
of every tensor, rounded to bfloat16 so that the same weights loaded in f32 or bf16 agree) and
``check_head_target`` refuses a head whose fingerprint differs from the loaded target's.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from confu_jax import storage
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.params import trainable_shapes
from confu_jax.models.spec import model_spec_from_config
from confu_jax.runs.checkpoint import Checkpointer, restore_args_for
from confu_jax.runs.trainable_export import TrainedHead, is_trainable_export, load_trainable_export, write_trainable

TARGET_FILE = "target.json"
# Elements sampled (evenly strided) from each tensor for the fingerprint: enough that two
# fine-tunes of one base differ, small enough to hash an 8B target in well under a second.
_FINGERPRINT_SAMPLES = 4096


def read_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, "config.json")
    if not storage.isfile(path):
        found = sorted(storage.listdir(workdir)) if storage.isdir(workdir) else "directory does not exist"
        raise FileNotFoundError(f"{path} not found: not a launch.train workdir (contents: {found})")
    with storage.open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def load_trained_head(workdir: str, step: Optional[int] = None) -> TrainedHead:
    """(config, spec, trainable, draft_vocab, step) of ``workdir``'s latest (or ``step``) checkpoint,
    or of a trainable-tree export (``runs.trainable_export``: ConFu releases) in its place."""
    workdir = storage.absolute(os.path.expanduser(workdir))
    if is_trainable_export(workdir):
        head = load_trainable_export(workdir)
        if step is not None and int(step) != head.step:
            raise FileNotFoundError(f"{workdir} is an export of step {head.step}, not of step {step}")
        return head
    config = read_config(workdir)
    try:
        spec = model_spec_from_config(config)
    except (KeyError, AttributeError, ValueError) as e:
        raise ValueError(f"{workdir}/config.json does not describe a draft head: {e}") from e
    ckdir = os.path.join(workdir, "checkpoints")
    if not storage.isdir(ckdir):
        raise FileNotFoundError(f"{ckdir} not found: the run in {workdir} saved no checkpoint yet")
    ckpt = Checkpointer(ckdir, read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {ckdir} (contents: {sorted(storage.listdir(ckdir))}; "
                                    "an interrupted save leaves only a tmp directory)")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"{ckdir} has no checkpoint for step {step}; it has {steps}")
        abstract = {"params": trainable_shapes(spec)}
        out = ckpt.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args_for(abstract),
                                         partial_restore=True),
            extras=ocp.args.PyTreeRestore()))
    finally:
        ckpt.close()
    trainable = jax.tree_util.tree_map(np.asarray, out["state"]["params"])
    want = jax.tree_util.tree_map(lambda a: (tuple(a.shape), str(a.dtype)), abstract["params"])
    got = jax.tree_util.tree_map(lambda a: (tuple(a.shape), str(a.dtype)), trainable)
    if want != got:
        raise ValueError(f"{ckdir} step {step}: params do not match the head in config.json "
                         f"(expected {want}, found {got})")
    extras = dict(out["extras"] or {})
    missing = [k for k in ("draft_vocab_d2t", "draft_vocab_t2d") if k not in extras]
    if missing:
        raise KeyError(f"{ckdir} step {step}: extras lack {missing} (found {sorted(extras)})")
    d2t = np.asarray(extras["draft_vocab_d2t"], np.int32)
    t2d = np.asarray(extras["draft_vocab_t2d"])
    if d2t.shape != (spec.head.draft_vocab_size,) or t2d.shape != (spec.target.vocab_size,):
        raise ValueError(f"{ckdir} step {step}: draft vocab d2t {d2t.shape} / t2d {t2d.shape}, expected "
                         f"({spec.head.draft_vocab_size},) / ({spec.target.vocab_size},)")
    return TrainedHead(config, spec, trainable, {"d2t": d2t, "t2d": t2d}, step)


# ----------------------------------------------------------------------------- target identity


def target_fingerprint(target_params) -> str:
    """SHA-256 over every tensor's path, shape and an evenly strided sample of its values (bf16).

    Equal for the same weights whatever their dtype (f32 / bf16 / f16 rounded alike) or placement;
    different for two checkpoints of one architecture (a base and an instruct model).
    """
    import hashlib

    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(target_params),
                             key=lambda pl: jax.tree_util.keystr(pl[0])):
        sample = _fingerprint_sample(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(np.shape(leaf))};".encode())
        h.update(np.ascontiguousarray(sample.astype(np.float32).astype(jnp.bfloat16)).tobytes())
    return h.hexdigest()


def _fingerprint_sample(leaf) -> np.ndarray:
    """The strided sample of one tensor, taken where the array lives: only the sample reaches the host
    (a global array sharded over several processes is sampled under jit into a replicated result)."""
    size = int(np.prod(np.shape(leaf)))
    stride = max(1, size // _FINGERPRINT_SAMPLES)

    def take(x):
        return x.reshape(-1)[::stride][:_FINGERPRINT_SAMPLES]

    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.sharding import NamedSharding, PartitionSpec

        out = jax.jit(take, out_shardings=NamedSharding(leaf.sharding.mesh, PartitionSpec()))(leaf)
        return np.asarray(out.addressable_data(0))
    return np.asarray(take(leaf))


def write_target_record(workdir: str, fingerprint: str, source: str) -> None:
    """``<workdir>/target.json``: which target a run trains against (read by ``check_head_target``)."""
    storage.write_text(os.path.join(workdir, TARGET_FILE),
                       json.dumps({"fingerprint": fingerprint, "source": source}, indent=2))


def read_target_record(workdir: str) -> Optional[dict]:
    """The run's ``target.json``, or None for workdirs written before it existed."""
    path = os.path.join(workdir, TARGET_FILE)
    if not storage.isfile(path):
        return None
    with storage.open(path) as f:
        record = json.load(f)
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        raise ValueError(f"{path}: expected a JSON object with a string 'fingerprint', found {record!r}")
    return record


def check_run_fingerprint(workdir: str, target_params, target_source: str, why: str) -> None:
    """Refuse a run (``target.json``) trained against other target weights than ``target_params``;
    ``why`` says what of the target the run's parameters depend on. Runs without a record pass."""
    record = read_target_record(workdir)
    if record is not None and record["fingerprint"] != target_fingerprint(target_params):
        raise ValueError(f"{workdir} was trained against another target ({record.get('source', '?')!r}, weights "
                         f"fingerprint {record['fingerprint'][:16]}...) than {target_source}: {why}")


_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim")


def check_head_target(head: TrainedHead, workdir: str, target_cfg: LlamaConfig, target_params,
                      target_source: str = "the loaded target") -> None:
    """Refuse a head trained for another target: architecture first, then the weights' fingerprint.

    Workdirs from before fingerprints were recorded pass the architecture check only, with a
    warning (their target cannot be verified).
    """
    trained_t = head.spec.target
    for field in _SHAPE_FIELDS:
        if getattr(trained_t, field) != getattr(target_cfg, field):
            trained_on = head.config.model.get("preset", None) or head.config.model.get("source", "?")
            raise ValueError(f"{workdir} was trained on {trained_on!r} with {field}="
                             f"{getattr(trained_t, field)}; the loaded target has {getattr(target_cfg, field)}")
    record = read_target_record(workdir)
    if record is None:
        import logging

        logging.warning("%s has no %s (written by runs before target fingerprints): cannot check that "
                        "the head was trained for %s", workdir, TARGET_FILE, target_source)
        return
    have = target_fingerprint(target_params)
    if record["fingerprint"] != have:
        raise ValueError(
            f"{workdir} was trained against a different target: its {TARGET_FILE} records "
            f"{record.get('source', '?')!r} with weights fingerprint {record['fingerprint'][:16]}..., "
            f"{target_source} has fingerprint {have[:16]}... (same architecture, different weights, "
            "e.g. a base model and its instruct fine-tune). A head only accelerates the target it "
            "was trained for; load that target, or train a head for this one.")


# ----------------------------------------------------------------------------- other drafter families' runs


def is_family_workdir(path: str, section: str) -> bool:
    """A ``launch.train`` workdir (config.json + checkpoints/) whose config has a ``section`` section
    (``medusa``, ``mlp_speculator``, ``mtp``: the family it trained)."""
    cfg = os.path.join(path, "config.json")
    if not (storage.isdir(os.path.join(path, "checkpoints")) and storage.isfile(cfg)):
        return False
    with storage.open(cfg) as f:
        c = json.load(f)
    return isinstance(c, dict) and section in c


def load_family_run(workdir: str, section: str, abstract_fn, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target", why: str = ""):
    """The trained parameters of another drafter family's run -> (params, step, config, workdir):
    its config must have ``section``; its target fingerprint must be ``target_params``'
    (``check_run_fingerprint``, ``why`` says what of the target it reads); ``abstract_fn(config)``
    gives the checkpoint's abstract tree (``runs.checkpoint.restore_params``: last step, or ``step``)."""
    from confu_jax.runs.checkpoint import restore_params

    workdir = storage.absolute(os.path.expanduser(workdir))
    config = read_config(workdir)
    if section not in config:
        raise ValueError(f"{workdir}/config.json has no {section!r} section: not a {section} run")
    check_run_fingerprint(workdir, target_params, target_source, why)
    params, step = restore_params(os.path.join(workdir, "checkpoints"), abstract_fn(config), step)
    return params, step, config, workdir


def export_trainable(workdir: str, out: str, *, step=None, dtype: str = "bfloat16") -> dict:
    """Write the head of ``workdir``'s checkpoint ``step`` (default: the latest) to ``out`` as a
    trainable-tree export (``runs.trainable_export``); returns ``export.json``'s content."""
    head = load_trained_head(workdir, step)
    return write_trainable(head, out, dtype=dtype, config_file=os.path.join(workdir, "config.json"),
                           target_file=os.path.join(workdir, TARGET_FILE))
