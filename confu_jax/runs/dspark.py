"""A trained DSpark run (``launch.train`` with ``configs/*_dspark.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dspark': ...}}``, ``models.dspark``), whose shapes follow from the target and the run's
``dspark`` section; the mask token and block size are the run's config; its ``target.json`` says which
target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import Optional

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.dflash import DFlashRun, load_block_run
from confu_jax.runs.exports import ExportFormat, dtype_text, speculators_verifier, target_dtype


DSparkRun = DFlashRun  # the same fields: a block draft's tree, layer config, taps, mask, block, step, source


def is_dspark_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dspark`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dspark")


def load_dspark_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DSparkRun:
    """A DSpark run's draft (``runs.dflash.load_block_run``; its Markov and confidence heads from its section)."""
    from confu_jax.models.dspark import init_shapes

    def shapes(dcfg, n_taps, dc):
        return init_shapes(dcfg, n_taps, target_cfg.vocab_size, rank=int(dc["markov_rank"]),
                           kind=str(dc["markov_head_type"]), confidence=bool(dc["enable_confidence_head"]),
                           confidence_with_markov=bool(dc["confidence_head_with_markov"]))

    return load_block_run(workdir, "dspark", shapes, target_cfg, target_params, step=step,
                          target_source=target_source, name="DSpark")


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_dspark(workdir, out, *, step=None, dtype=None, target, target_source, warn=None, verifier=None) -> str:
    import os

    from confu_jax.weights.dspark_format import save_dspark_dir
    from confu_jax.weights.head_dirs import store_dtype

    cfg, tp = target
    dtype = dtype or target_dtype(target_source)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    run = load_dspark_run(workdir, cfg, tp, step=step, target_source=target_source)
    save_dspark_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                    block_size=run.block_size, **speculators_verifier(workdir, cfg, verifier, target_source),
                    dtype=store_dtype(dtype_text(dtype)))
    return (f"exported {workdir} (step {run.step}, DSpark draft, blocks of {run.block_size}, mask "
            f"{run.mask_token_id}) to {out} in speculators' dspark layout ({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="dspark", write=_write_dspark, reads_target=True, options=("verifier",),
                             help="speculators' dspark layout (vLLM's Qwen3DSparkForCausalLM; a DSpark run)")
