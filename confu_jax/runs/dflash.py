"""A trained DFlash run (``launch.train`` with ``configs/*_dflash.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dflash': ...}}``, ``models.dflash``), whose shapes follow from the target, the run's
``dflash.num_layers`` and its taps; the mask token and block size are the run's config; its
``target.json`` says which target it was trained on (the draft reads that target's taps and uses its
embedding and LM head).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.dflash import default_taps, draft_config, trainable_shapes
from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


class DFlashRun(NamedTuple):
    """A block-draft run as decode loads it: DFlash's and JetSpec's, and DSpark's, DFlash2's and Domino's
    (``runs.dspark`` / ``dflash2`` / ``domino``), all read by ``load_block_run``."""

    params: dict  # numpy models.dflash (or models.dspark / dflash2 / domino) tree, no decode scalars
    draft: LlamaConfig
    taps: tuple
    mask_token_id: int
    block_size: int
    step: int
    source: str
    causal_head: bool = False  # dflash.causal_head: a JetSpec run (the block attends causally)
    section: Optional[dict] = None  # the run's family section (DFlash2's selector K, Domino's prefix length, ...)


def is_dflash_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dflash`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dflash")


def run_taps(config: dict, target_cfg: LlamaConfig) -> tuple:
    """A block-draft run's taps: ``draft.tap_layers``, else DFlash's default layers of the target (DSpark too)."""
    taps = (config.get("draft") or {}).get("tap_layers")
    return tuple(int(t) for t in taps) if taps is not None else default_taps(target_cfg.n_layers)


def load_block_run(workdir: str, family: str, shapes, target_cfg: LlamaConfig, target_params, *,
                   step: Optional[int] = None, target_source: str = "the loaded target",
                   name: str = "") -> DFlashRun:
    """The draft of a block-draft run (last checkpoint, or ``step``), target checked by fingerprint: the one
    reader of the five block families, whose checkpoints hold ``{'draft': {family: tree}}`` of a backbone of
    ``<family>.num_layers`` layers of the target's shape over the run's taps, with the mask token and block
    size in the run's ``family`` section. ``shapes(draft_cfg, n_taps, section)`` gives the tree's abstract
    shapes (what the family adds to the backbone follows from its section)."""
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        dcfg = draft_config(target_cfg, int(config[family]["num_layers"]))
        return {"draft": {family: shapes(dcfg, len(run_taps(config, target_cfg)), config[family])}}

    params, step, config, workdir = load_family_run(
        workdir, family, abstract, target_params, step=step, target_source=target_source,
        why=f"a {name or family} draft reads its own target's taps, embedding and LM head")
    section = dict(config[family])
    return DFlashRun(jax.tree_util.tree_map(np.asarray, params["draft"][family]),
                     draft_config(target_cfg, int(section["num_layers"])), run_taps(config, target_cfg),
                     int(section["mask_token_id"]), int(section["block_size"]), step, f"{workdir} (step {step})",
                     bool(section.get("causal_head", False)), section)


def load_dflash_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DFlashRun:
    """A DFlash (or JetSpec: ``causal_head``) run's draft (``load_block_run``)."""
    return load_block_run(workdir, "dflash", lambda dcfg, n_taps, _: trainable_shapes(dcfg, n_taps), target_cfg,
                          target_params, step=step, target_source=target_source, name="DFlash")


def export_dflash_run(workdir: str, out: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                      dtype: str = "float32", target_source: str = "the loaded target",
                      causal_head: bool = False) -> DFlashRun:
    """Write a run's draft in the published DFlash layout (``weights.dflash_format``); ``causal_head``: the
    run must be a JetSpec run (``dflash.causal_head``), written with the flag — and a DFlash export refuses one."""
    from confu_jax.weights.dflash_format import save_dflash_dir
    from confu_jax.weights.head_dirs import store_dtype

    store = store_dtype(dtype)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if not is_dflash_workdir(workdir):
        raise ValueError(f"{workdir}: not a DFlash launch.train workdir (config.json with a 'dflash' section + "
                         "checkpoints/)")
    run = load_dflash_run(workdir, target_cfg, target_params, step=step, target_source=target_source)
    if run.causal_head != causal_head:
        raise ValueError(f"{workdir}: a {'JetSpec' if run.causal_head else 'DFlash'} run (dflash.causal_head = "
                         f"{run.causal_head}); export it with --format {'jetspec' if run.causal_head else 'dflash'}")
    save_dflash_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                    block_size=run.block_size, num_target_layers=target_cfg.n_layers, dtype=store,
                    causal_head=run.causal_head)
    return run


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_dflash(workdir, out, *, step=None, dtype=None, target, target_source, warn=None) -> str:
    dtype = dtype or target_dtype(target_source)
    run = export_dflash_run(workdir, out, *target, step=step, dtype=dtype_text(dtype), target_source=target_source)
    return (f"exported {workdir} (step {run.step}, DFlash: {run.draft.n_layers} layers over target layers "
            f"{[t - 1 for t in run.taps]}, block {run.block_size}, mask {run.mask_token_id}) to {out} in the "
            f"dflash format (DFlashDraftModel; model.safetensors + config.json, {dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="dflash", write=_write_dflash, reads_target=True,
                             help="z-lab's DFlashDraftModel model.safetensors + config.json (a DFlash run)")


def _write_jetspec(workdir, out, *, step=None, dtype=None, target, target_source, warn=None) -> str:
    dtype = dtype or target_dtype(target_source)
    run = export_dflash_run(workdir, out, *target, step=step, dtype=dtype_text(dtype), target_source=target_source,
                            causal_head=True)
    return (f"exported {workdir} (step {run.step}, JetSpec: {run.draft.n_layers} causal layers over target layers "
            f"{[t - 1 for t in run.taps]}, block {run.block_size}, mask {run.mask_token_id}) to {out} in the "
            f"jetspec format (DFlashDraftModel with dflash_config.causal_head; model.safetensors + config.json, "
            f"{dtype_text(dtype)})")


EXPORT_FORMAT_JETSPEC = ExportFormat(
    name="jetspec", write=_write_jetspec, reads_target=True,
    help="JetSpec's DFlashDraftModel (dflash_config.causal_head) model.safetensors + config.json (a JetSpec run)")
