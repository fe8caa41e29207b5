"""A trained MTP run (``launch.train`` with ``configs/*_mtp.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the module
(``{'draft': {'mtp': ...}}``, ``models.mtp``), whose shapes follow from the target alone (one of its
decoder layers), and its ``target.json`` says which target it was trained on (the module reads that
target's hidden states and uses its embedding and LM head).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.runs.exports import ExportFormat, dtype_text, target_dtype
from confu_jax.models.mtp import trainable_shapes


class MTPRun(NamedTuple):
    params: dict  # numpy models.mtp tree
    step: int
    source: str


def is_mtp_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has an ``mtp`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "mtp")


def load_mtp_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                 target_source: str = "the loaded target") -> MTPRun:
    """The module of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.runs.heads import load_family_run

    params, step, _, workdir = load_family_run(
        workdir, "mtp", lambda config: {"draft": {"mtp": trainable_shapes(target_cfg)}}, target_params, step=step,
        target_source=target_source, why="an MTP module reads its own target's hidden states, embedding and LM head")
    return MTPRun(jax.tree_util.tree_map(np.asarray, params["draft"]["mtp"]), step, f"{workdir} (step {step})")


def export_mtp_run(workdir: str, out: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                   dtype: str = "float32", include_shared: bool = False,
                   target_source: str = "the loaded target") -> MTPRun:
    """Write a run's module in DeepSeek-V3's MTP layout (``weights.mtp_format``: ``model.safetensors`` +
    ``config.json``). The target (the one the run trained on) is the caller's to load
    (``launch.export_head`` loads it from the run's config). ``dtype``: float32, bfloat16 or float16;
    ``include_shared``: also write the target's embedding and LM head as the layer's ``embed_tokens`` /
    ``shared_head.head`` (DeepSeek's checkpoints carry them; readers here check them against the target)."""
    from confu_jax.weights.head_dirs import store_dtype
    from confu_jax.weights.mtp_format import save_mtp_dir

    store = store_dtype(dtype)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if not is_mtp_workdir(workdir):
        raise ValueError(f"{workdir}: not an MTP launch.train workdir (config.json with an 'mtp' section + "
                         "checkpoints/)")
    run = load_mtp_run(workdir, target_cfg, target_params, step=step, target_source=target_source)
    save_mtp_dir(out, run.params, target_cfg, target_params=target_params if include_shared else None, dtype=store)
    return run


# ----------------------------------------------------------------------------- export (launch.export_head)


def _write_mtp(workdir, out, *, step=None, dtype=None, target, target_source, warn=None,
               mtp_shared=False) -> str:
    dtype = dtype or target_dtype(target_source)
    run = export_mtp_run(workdir, out, *target, step=step, dtype=dtype_text(dtype), include_shared=mtp_shared,
                         target_source=target_source)
    return (f"exported {workdir} (step {run.step}, MTP module: layer model.layers.{target[0].n_layers}"
            f"{', with the shared embedding / LM head' if mtp_shared else ''}) to {out} in the mtp format "
            f"(DeepSeek-V3 names; model.safetensors + config.json, {dtype_text(dtype)})")


EXPORT_FORMAT = ExportFormat(name="mtp", write=_write_mtp, reads_target=True, options=("mtp_shared",),
                             help="DeepSeek-V3's MTP layer names around a Llama layer (an MTP run)")
