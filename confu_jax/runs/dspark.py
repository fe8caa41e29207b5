"""A trained DSpark run (``launch.train`` with ``configs/*_dspark.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dspark': ...}}``, ``models.dspark``), whose shapes follow from the target and the run's
``dspark`` section; the mask token and block size are the run's config; its ``target.json`` says which
target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from confu_jax.models.dflash import draft_config
from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.dflash import DFlashRun, run_taps
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


DSparkRun = DFlashRun  # the same fields: a block draft's tree, layer config, taps, mask, block, step, source


def is_dspark_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dspark`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dspark")


def load_dspark_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DSparkRun:
    """The draft of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.models.dspark import init_shapes
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        dc = config["dspark"]
        dcfg = draft_config(target_cfg, int(dc["num_layers"]))
        shapes = init_shapes(dcfg, len(run_taps(config, target_cfg)), target_cfg.vocab_size, rank=int(dc["markov_rank"]),
                             kind=str(dc["markov_head_type"]), confidence=bool(dc["enable_confidence_head"]),
                             confidence_with_markov=bool(dc["confidence_head_with_markov"]))
        return {"draft": {"dspark": shapes}}

    params, step, config, workdir = load_family_run(
        workdir, "dspark", abstract, target_params, step=step, target_source=target_source,
        why="a DSpark draft reads its own target's taps, embedding and LM head")
    dc = config["dspark"]
    return DSparkRun(jax.tree_util.tree_map(np.asarray, params["draft"]["dspark"]),
                     draft_config(target_cfg, int(dc["num_layers"])), run_taps(config, target_cfg), int(dc["mask_token_id"]),
                     int(dc["block_size"]), step, f"{workdir} (step {step})")


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_dspark(workdir, out, *, step=None, dtype=None, target, target_source, warn=None, verifier=None) -> str:
    import os

    from confu_jax.runs.heads import read_target_record
    from confu_jax.weights.dspark_format import save_dspark_dir
    from confu_jax.weights.head_dirs import store_dtype
    from confu_jax.weights.hf import SUPPORTED_MODEL_TYPES
    from confu_jax.weights.export import model_type_of

    cfg, tp = target
    dtype = dtype or target_dtype(target_source)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    run = load_dspark_run(workdir, cfg, tp, step=step, target_source=target_source)
    record = read_target_record(workdir) or {}
    save_dspark_dir(out, run.params, run.draft, taps=run.taps, mask_token_id=run.mask_token_id,
                    block_size=run.block_size, verifier=verifier or record.get("source") or target_source,
                    verifier_arch=SUPPORTED_MODEL_TYPES[model_type_of(cfg)], dtype=store_dtype(dtype_text(dtype)))
    return (f"exported {workdir} (step {run.step}, DSpark draft, blocks of {run.block_size}, mask "
            f"{run.mask_token_id}) to {out} in speculators' dspark layout ({dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="dspark", write=_write_dspark, reads_target=True, options=("verifier",),
                             help="speculators' dspark layout (vLLM's Qwen3DSparkForCausalLM; a DSpark run)")
