"""A trained MLP speculator run (``launch.train`` with ``configs/*_mlp_speculator.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the
speculator in its trainable layout (``{'draft': {'mlp_speculator': ...}}``,
``models.mlp_speculator.to_trainable``: tied weights once), whose shapes follow from
``config.mlp_speculator`` and the target, and its ``target.json`` says which target it was trained on.
Loading restores that tree (``runs.checkpoint.restore_params``) and broadcasts it to the stage
layout decoding reads (``from_trainable``).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype
from confu_jax.models.mlp_speculator import MLPSpeculatorConfig, from_trainable, make_config, trainable_shapes


class MLPSpeculatorRun(NamedTuple):
    params: dict  # numpy models.mlp_speculator stage-layout tree
    config: MLPSpeculatorConfig
    step: int
    source: str


def is_mlp_speculator_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has an ``mlp_speculator`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "mlp_speculator")


def run_speculator_config(section, target_cfg: LlamaConfig) -> MLPSpeculatorConfig:
    """The speculator of a config's ``mlp_speculator`` section on ``target_cfg`` (d = its width, V = its
    vocabulary; the section's ``inner_dim`` 0 = d)."""
    return make_config(int(section.n_predict), target_cfg.d_model, target_cfg.vocab_size, int(section.inner_dim),
                       bool(section.tie_weights), bool(section.scale_input))


def load_mlp_speculator_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                            target_source: str = "the loaded target") -> MLPSpeculatorRun:
    """The speculator of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        return {"draft": {"mlp_speculator": trainable_shapes(run_speculator_config(config.mlp_speculator, target_cfg))}}

    params, step, config, workdir = load_family_run(workdir, "mlp_speculator", abstract, target_params, step=step,
                                                    target_source=target_source,
                                                    why="an MLP speculator reads its own target's hidden states")
    c = run_speculator_config(config.mlp_speculator, target_cfg)
    stage = jax.tree_util.tree_map(np.asarray, from_trainable(params["draft"]["mlp_speculator"], c))
    return MLPSpeculatorRun(stage, c, step, f"{workdir} (step {step})")


def export_mlp_speculator_run(workdir: str, out: str, target_cfg: LlamaConfig, target_params, *,
                              step: Optional[int] = None, dtype: str = "float32",
                              target_source: str = "the loaded target") -> MLPSpeculatorRun:
    """Write a run's speculator in the published format (``weights.mlp_speculator_format``:
    ``model.safetensors`` + ``config.json``, model_type ``mlp_speculator``), which fms-extras and vLLM
    load. The target (the one the run trained on: shapes and the fingerprint check need it) is the
    caller's to load (``launch.export_head`` loads it from the run's config). ``dtype``: float32,
    bfloat16 or float16; ``tie_weights`` is the run's."""
    from confu_jax.weights.head_dirs import store_dtype
    from confu_jax.weights.mlp_speculator_format import save_mlp_speculator_dir

    store = store_dtype(dtype)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if not is_mlp_speculator_workdir(workdir):
        raise ValueError(f"{workdir}: not an MLP speculator launch.train workdir (config.json with an "
                         "'mlp_speculator' section + checkpoints/)")
    run = load_mlp_speculator_run(workdir, target_cfg, target_params, step=step, target_source=target_source)
    save_mlp_speculator_dir(out, run.params, tie_weights=run.config.tie_weights, dtype=store)
    return run


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_mlp_speculator(workdir, out, *, step=None, dtype=None, target, target_source, warn=None) -> str:
    dtype = dtype or target_dtype(target_source)
    run = export_mlp_speculator_run(workdir, out, *target, step=step, dtype=dtype_text(dtype),
                                    target_source=target_source)
    c = run.config
    return (f"exported {workdir} (step {run.step}, MLP speculator: {c.n_predict} stages, inner_dim {c.inner_dim}"
            f"{', tied' if c.tie_weights else ''}{', scale_input' if c.scale_input else ''}) to {out} in the "
            f"mlp_speculator format (model.safetensors + config.json, {dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="mlp_speculator", write=_write_mlp_speculator, reads_target=True,
                             help="fms-extras / vLLM model.safetensors + config.json (an MLP speculator run)")
