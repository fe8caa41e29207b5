"""A trained DFlash2 run (``launch.train`` with ``configs/*_dflash2.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dflash2': ...}}``, ``models.dflash2``), whose shapes follow from the target and the run's
``dflash2`` section; the mask token, block size and the selector's K are the run's config; its ``target.json``
says which target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.dflash import draft_config
from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.dflash import run_taps
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


class DFlash2Run(NamedTuple):
    params: dict  # numpy models.dflash2 tree, no decode scalars
    draft: LlamaConfig
    taps: tuple
    mask_token_id: int
    block_size: int
    top_k: int
    step: int
    source: str


def is_dflash2_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dflash2`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dflash2")


def shape_kwargs(section: dict, d_model: int) -> dict:
    """``models.dflash2.init_dflash2``'s shape arguments from a run's ``dflash2`` section."""
    return {"kernel_size": int(section["conv_kernel_size"]), "group_size": int(section["conv_group_size"]),
            "rank": int(section["selector_rank"])}


def load_dflash2_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                     target_source: str = "the loaded target") -> DFlash2Run:
    """The draft of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.models.dflash2 import init_shapes
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        dc = config["dflash2"]
        dcfg = draft_config(target_cfg, int(dc["num_layers"]))
        return {"draft": {"dflash2": init_shapes(dcfg, len(run_taps(config, target_cfg)), target_cfg.vocab_size,
                                                 **shape_kwargs(dc, target_cfg.d_model))}}

    params, step, config, workdir = load_family_run(
        workdir, "dflash2", abstract, target_params, step=step, target_source=target_source,
        why="a DFlash2 draft reads its own target's taps, embedding and LM head")
    dc = config["dflash2"]
    return DFlash2Run(jax.tree_util.tree_map(np.asarray, params["draft"]["dflash2"]),
                      draft_config(target_cfg, int(dc["num_layers"])), run_taps(config, target_cfg),
                      int(dc["mask_token_id"]), int(dc["block_size"]), int(dc["selector_top_k"]), step,
                      f"{workdir} (step {step})")


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_dflash2(workdir, out, *, step=None, dtype=None, target, target_source, warn=None, verifier=None) -> str:
    import os

    from confu_jax.runs.heads import read_target_record
    from confu_jax.weights.dflash2_format import save_dflash2_dir
    from confu_jax.weights.export import model_type_of
    from confu_jax.weights.head_dirs import store_dtype
    from confu_jax.weights.hf import SUPPORTED_MODEL_TYPES

    cfg, tp = target
    dtype = dtype or target_dtype(target_source)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    run = load_dflash2_run(workdir, cfg, tp, step=step, target_source=target_source)
    record = read_target_record(workdir) or {}
    save_dflash2_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                     block_size=run.block_size, top_k=run.top_k,
                     verifier=verifier or record.get("source") or target_source,
                     verifier_arch=SUPPORTED_MODEL_TYPES[model_type_of(cfg)], dtype=store_dtype(dtype_text(dtype)))
    return (f"exported {workdir} (step {run.step}, DFlash2 draft, blocks of {run.block_size}, mask "
            f"{run.mask_token_id}, selector top {run.top_k}) to {out} in speculators' dflash2 layout "
            f"({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="dflash2", write=_write_dflash2, reads_target=True, options=("verifier",),
                             help="speculators' dflash2 layout (vLLM's DFlash2Qwen3ForCausalLM; a DFlash2 run)")
