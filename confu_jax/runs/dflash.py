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
    """A block-draft run as decode loads it (DFlash's; DSpark's, ``runs.dspark``, has the same fields)."""

    params: dict  # numpy models.dflash (or models.dspark) tree, no decode scalars
    draft: LlamaConfig
    taps: tuple
    mask_token_id: int
    block_size: int
    step: int
    source: str
    causal_head: bool = False  # dflash.causal_head: a JetSpec run (the block attends causally)


def is_dflash_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dflash`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dflash")


def run_taps(config: dict, target_cfg: LlamaConfig) -> tuple:
    """A block-draft run's taps: ``draft.tap_layers``, else DFlash's default layers of the target (DSpark too)."""
    taps = (config.get("draft") or {}).get("tap_layers")
    return tuple(int(t) for t in taps) if taps is not None else default_taps(target_cfg.n_layers)


def load_dflash_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DFlashRun:
    """The draft of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        dcfg = draft_config(target_cfg, int(config["dflash"]["num_layers"]))
        return {"draft": {"dflash": trainable_shapes(dcfg, len(run_taps(config, target_cfg)))}}

    params, step, config, workdir = load_family_run(
        workdir, "dflash", abstract, target_params, step=step, target_source=target_source,
        why="a DFlash draft reads its own target's taps, embedding and LM head")
    dc = config["dflash"]
    return DFlashRun(jax.tree_util.tree_map(np.asarray, params["draft"]["dflash"]),
                     draft_config(target_cfg, int(dc["num_layers"])), run_taps(config, target_cfg),
                     int(dc["mask_token_id"]), int(dc["block_size"]), step, f"{workdir} (step {step})",
                     bool(dc.get("causal_head", False)))


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
