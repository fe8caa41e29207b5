"""A trained Medusa run (``launch.train`` with ``configs/*_medusa.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the
heads (``{'draft': {'medusa': ...}}``, ``models.medusa``), whose shapes follow from
``config.medusa`` and the target, and its ``target.json`` says which target they were trained on.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.llama import LlamaConfig


class MedusaRun(NamedTuple):
    heads: dict  # numpy models.medusa tree
    step: int
    source: str


def is_medusa_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``medusa`` section."""
    cfg = os.path.join(path, "config.json")
    if not (os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(cfg)):
        return False
    with open(cfg) as f:
        return "medusa" in json.load(f)


def medusa_shapes(num_heads: int, num_layers: int, target_cfg: LlamaConfig, target_params) -> dict:
    """ShapeDtypeStructs of a Medusa run's trainable tree (float32, V = the target LM head's rows)."""
    from confu_jax.models.target import embedding_table

    d = target_cfg.d_model
    v = (embedding_table(target_params).shape[0] if target_cfg.tie_embeddings
         else target_params["lm_head"]["kernel"].shape[1])
    f32 = np.float32
    s = jax.ShapeDtypeStruct
    return {"draft": {"medusa": {"resblocks": {"kernel": s((num_heads, num_layers, d, d), f32),
                                               "bias": s((num_heads, num_layers, d), f32)},
                                 "lm_head": {"kernel": s((num_heads, d, v), f32)}}}}


def load_medusa_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> MedusaRun:
    """The heads of a Medusa workdir (last checkpoint, or ``step``), target checked by fingerprint."""
    import orbax.checkpoint as ocp

    from confu_jax.runs.checkpoint import Checkpointer, restore_args_for
    from confu_jax.runs.heads import read_config, read_target_record, target_fingerprint

    workdir = os.path.abspath(os.path.expanduser(workdir))
    config = read_config(workdir)
    if "medusa" not in config:
        raise ValueError(f"{workdir}/config.json has no 'medusa' section: not a Medusa run")
    record = read_target_record(workdir)
    if record is not None and record["fingerprint"] != target_fingerprint(target_params):
        raise ValueError(f"{workdir} was trained against another target ({record.get('source', '?')!r}, weights "
                         f"fingerprint {record['fingerprint'][:16]}...) than {target_source}: Medusa heads read "
                         "their own target's hidden states")
    abstract = {"params": medusa_shapes(int(config.medusa.num_heads), int(config.medusa.num_layers), target_cfg,
                                        target_params)}
    ckdir = os.path.join(workdir, "checkpoints")
    ckpt = Checkpointer(ckdir, read_only=True)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {ckdir}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"{ckdir} has no checkpoint for step {step}; it has {steps}")
        out = ckpt.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args_for(abstract),
                                         partial_restore=True)))
    finally:
        ckpt.close()
    heads = jax.tree_util.tree_map(np.asarray, out["state"]["params"])["draft"]["medusa"]
    return MedusaRun(heads, step, f"{workdir} (step {step})")
