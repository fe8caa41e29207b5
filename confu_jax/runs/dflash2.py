"""A trained DFlash2 run (``launch.train`` with ``configs/*_dflash2.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dflash2': ...}}``, ``models.dflash2``), whose shapes follow from the target and the run's
``dflash2`` section; the mask token, block size and the selector's K are the run's config; its ``target.json``
says which target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import Optional

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.dflash import DFlashRun, load_block_run
from confu_jax.runs.exports import ExportFormat, dtype_text, speculators_verifier, target_dtype


def is_dflash2_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dflash2`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dflash2")


def shape_kwargs(section: dict, d_model: int) -> dict:
    """``models.dflash2.init_dflash2``'s shape arguments from a run's ``dflash2`` section."""
    return {"kernel_size": int(section["conv_kernel_size"]), "group_size": int(section["conv_group_size"]),
            "rank": int(section["selector_rank"])}


def load_dflash2_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                     target_source: str = "the loaded target") -> DFlashRun:
    """A DFlash2 run's draft (``runs.dflash.load_block_run``; its convolutions and selector from its section,
    the selector's K: ``top_k(run)``)."""
    from confu_jax.models.dflash2 import init_shapes

    return load_block_run(workdir, "dflash2", lambda dcfg, n_taps, dc: init_shapes(
        dcfg, n_taps, target_cfg.vocab_size, **shape_kwargs(dc, target_cfg.d_model)), target_cfg, target_params,
        step=step, target_source=target_source, name="DFlash2")


def top_k(run: DFlashRun) -> int:
    """The K candidates a DFlash2 run's selector reranks (its ``dflash2.selector_top_k``)."""
    return int(run.section["selector_top_k"])


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_dflash2(workdir, out, *, step=None, dtype=None, target, target_source, warn=None, verifier=None) -> str:
    import os

    from confu_jax.weights.dflash2_format import save_dflash2_dir
    from confu_jax.weights.head_dirs import store_dtype

    cfg, tp = target
    dtype = dtype or target_dtype(target_source)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    run = load_dflash2_run(workdir, cfg, tp, step=step, target_source=target_source)
    save_dflash2_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                     block_size=run.block_size, top_k=top_k(run),
                     **speculators_verifier(workdir, cfg, verifier, target_source), dtype=store_dtype(dtype_text(dtype)))
    return (f"exported {workdir} (step {run.step}, DFlash2 draft, blocks of {run.block_size}, mask "
            f"{run.mask_token_id}, selector top {top_k(run)}) to {out} in speculators' dflash2 layout "
            f"({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="dflash2", write=_write_dflash2, reads_target=True, options=("verifier",),
                             help="speculators' dflash2 layout (vLLM's DFlash2Qwen3ForCausalLM; a DFlash2 run)")
