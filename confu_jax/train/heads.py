"""Trained draft heads out of ``launch.train`` workdirs, for decoding and benchmarks.

A workdir holds ``config.json`` (written by ``train.loop.train`` at start) and
``checkpoints/<step>/`` (orbax: ``state`` with the trainable params, ``extras`` with the draft
vocabulary d2t / t2d). Only ``state.params`` is read back (partial restore): the optimizer state
is as large again and decoding never needs it. Everything comes back as host numpy arrays; the
caller places them.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from confu_jax.models.params import trainable_shapes
from confu_jax.models.spec import ModelSpec, model_spec_from_config


class TrainedHead(NamedTuple):
    config: ml_collections.ConfigDict  # the training config (model / confu / draft sections)
    spec: ModelSpec  # target preset's LlamaConfig + the head; swap in the loaded target's cfg
    trainable: dict  # {'draft': ..., 'confu': ...} as in models.params.init_trainable
    draft_vocab: dict  # {'d2t': int32 [V_draft], 't2d': bool [V_target]}
    step: int


def read_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        found = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else "directory does not exist"
        raise FileNotFoundError(f"{path} not found: not a launch.train workdir (contents: {found})")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def load_trained_head(workdir: str, step: Optional[int] = None) -> TrainedHead:
    """(config, spec, trainable, draft_vocab, step) of ``workdir``'s latest (or ``step``) checkpoint."""
    from confu_jax.train.checkpoint import Checkpointer, _restore_args_for

    workdir = os.path.abspath(os.path.expanduser(workdir))
    config = read_config(workdir)
    try:
        spec = model_spec_from_config(config)
    except (KeyError, AttributeError, ValueError) as e:
        raise ValueError(f"{workdir}/config.json does not describe a draft head: {e}") from e
    ckdir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckdir):
        raise FileNotFoundError(f"{ckdir} not found: the run in {workdir} saved no checkpoint yet")
    ckpt = Checkpointer(ckdir, read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {ckdir} (contents: {sorted(os.listdir(ckdir))}; "
                                    "an interrupted save leaves only a tmp directory)")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"{ckdir} has no checkpoint for step {step}; it has {steps}")
        abstract = {"params": trainable_shapes(spec)}
        out = ckpt.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=_restore_args_for(abstract),
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
