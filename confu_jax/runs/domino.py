"""A trained Domino run (``launch.train`` with ``configs/*_domino.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'domino': ...}}``, ``models.domino``), whose shapes follow from the target and the run's ``domino``
section; the mask token, block size and ``pure_draft_prefix_len`` are the run's config; its ``target.json`` says
which target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import Optional

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.dflash import DFlashRun, load_block_run
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


def is_domino_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``domino`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "domino")


def load_domino_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DFlashRun:
    """A Domino run's draft (``runs.dflash.load_block_run``; its GRU and projection from its section, its
    ``pure_draft_prefix_len``: ``prefix_len(run)``)."""
    from confu_jax.models.domino import init_shapes

    return load_block_run(workdir, "domino", lambda dcfg, n_taps, dc: init_shapes(
        dcfg, n_taps, target_cfg.vocab_size, gru_hidden_dim=int(dc["gru_hidden_dim"]), emb_dim=int(dc["emb_dim"])),
        target_cfg, target_params, step=step, target_source=target_source, name="Domino")


def prefix_len(run: DFlashRun) -> int:
    """The block slots a Domino run's GRU correction leaves alone (its ``domino.pure_draft_prefix_len``)."""
    return int(run.section["pure_draft_prefix_len"])


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_domino(workdir, out, *, step=None, dtype=None, target, target_source, warn=None) -> str:
    import os

    from confu_jax.weights.domino_format import save_domino_dir
    from confu_jax.weights.head_dirs import store_dtype

    cfg, tp = target
    dtype = dtype or target_dtype(target_source)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    run = load_domino_run(workdir, cfg, tp, step=step, target_source=target_source)
    save_domino_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                    block_size=run.block_size, num_target_layers=cfg.n_layers, prefix_len=prefix_len(run),
                    dtype=store_dtype(dtype_text(dtype)))
    return (f"exported {workdir} (step {run.step}, Domino draft, blocks of {run.block_size}, mask "
            f"{run.mask_token_id}) to {out} in SpecForge's DominoDraftModel layout ({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="domino", write=_write_domino, reads_target=True,
                             help="SpecForge's DominoDraftModel model.safetensors + config.json (a Domino run)")
