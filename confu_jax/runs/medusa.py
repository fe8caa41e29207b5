"""A trained Medusa run (``launch.train`` with ``configs/*_medusa.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the
heads (``{'draft': {'medusa': ...}}``, ``models.medusa``), whose shapes follow from
``config.medusa`` and the target, and its ``target.json`` says which target they were trained on.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype


class MedusaRun(NamedTuple):
    heads: dict  # numpy models.medusa tree
    step: int
    source: str


def is_medusa_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``medusa`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "medusa")


def medusa_shapes(num_heads: int, num_layers: int, target_cfg: LlamaConfig, target_params) -> dict:
    """ShapeDtypeStructs of a Medusa run's trainable tree (float32, V = the target LM head's rows)."""
    from confu_jax.models.target import lm_head_matrix

    d = target_cfg.d_model
    w, axis = lm_head_matrix(target_cfg, target_params)
    v = w.shape[axis]
    f32 = np.float32
    s = jax.ShapeDtypeStruct
    return {"draft": {"medusa": {"resblocks": {"kernel": s((num_heads, num_layers, d, d), f32),
                                               "bias": s((num_heads, num_layers, d), f32)},
                                 "lm_head": {"kernel": s((num_heads, d, v), f32)}}}}


def load_medusa_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> MedusaRun:
    """The heads of a Medusa workdir (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.runs.heads import load_family_run

    def abstract(config):
        return medusa_shapes(int(config.medusa.num_heads), int(config.medusa.num_layers), target_cfg, target_params)

    params, step, _, workdir = load_family_run(workdir, "medusa", abstract, target_params, step=step,
                                               target_source=target_source,
                                               why="Medusa heads read their own target's hidden states")
    heads = params["draft"]["medusa"]
    return MedusaRun(heads, step, f"{workdir} (step {step})")


def export_medusa_run(workdir: str, out: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                      dtype: str = "float32", target_source: str = "the loaded target") -> MedusaRun:
    """Write a Medusa run's heads in the FasterDecoding format (``weights.medusa_format``:
    ``medusa_lm_head.safetensors`` + ``config.json``), which Medusa's own code loads. The target
    (the one the run trained on: the heads' shapes and the fingerprint check need it) is the
    caller's to load (``launch.export_head`` loads it from the run's config). ``dtype``: float32,
    bfloat16 or float16; ``base_model_name_or_path`` records the run's target source."""
    from confu_jax.runs.heads import read_target_record
    from confu_jax.weights.head_dirs import store_dtype
    from confu_jax.weights.medusa_format import save_medusa_dir

    store = store_dtype(dtype)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if not is_medusa_workdir(workdir):
        raise ValueError(f"{workdir}: not a Medusa launch.train workdir (config.json with a 'medusa' section + "
                         "checkpoints/)")
    run = load_medusa_run(workdir, target_cfg, target_params, step=step, target_source=target_source)
    record = read_target_record(workdir) or {}
    save_medusa_dir(out, run.heads, base_model_name_or_path=record.get("source", ""), dtype=store)
    return run


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_medusa(workdir, out, *, step=None, dtype=None, target, target_source, warn=None) -> str:
    dtype = dtype or target_dtype(target_source)
    run = export_medusa_run(workdir, out, *target, step=step, dtype=dtype_text(dtype), target_source=target_source)
    return (f"exported {workdir} (step {run.step}, Medusa heads) to {out} in the FasterDecoding format "
            f"(medusa_lm_head.safetensors + config.json, {dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="medusa", write=_write_medusa, reads_target=True,
                             help="FasterDecoding's medusa_lm_head.safetensors + config.json (a Medusa run)")
