"""The export formats a trained run can be written in, one record each (:class:`ExportFormat`), for
``launch.export_head --format``: which family's runs it takes (``decode.families`` names the formats
of each family), whether it needs the run's target (the run's config says how to load it; the CLI
loads it, since loading a target is the training layer's), which extra options it reads, and the
function that writes it and returns the line the CLI prints.

Formats and their conventions: docs/interop.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Optional

log = logging.getLogger("confu_jax.export")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportFormat:
    """``write(workdir, out, *, step, dtype, target, target_source, warn, **options) -> summary``:
    ``target`` is ``(target_cfg, target_params)`` of the run's target when ``reads_target`` (else
    None); ``options`` are the names in ``options`` (the CLI refuses them for other formats);
    ``warn(message)`` reports what the export drops."""

    name: str
    write: Callable[..., str]
    reads_target: bool
    options: tuple = ()
    help: str = ""


def _dtype_text(dtype: Optional[str]) -> str:
    return dtype or "float32"


def _write_head(fmt: str):
    """EAGLE-3's official layout or vLLM's speculators format, from an EAGLE-3 or ConFu run (its
    EAGLE-3 part: serving engines have no contemplate tokens)."""

    def write(workdir, out, *, step=None, dtype=None, target=None, target_source="", warn=log.warning,
              embed_from=None, verifier=None) -> str:
        import json

        import numpy as np

        from confu_jax.runs.heads import check_head_target, load_trained_head, read_target_record
        from confu_jax.weights.eagle3_formats import eagle3_part, export_head

        if embed_from and fmt != "speculators":
            raise ValueError("embed_from is for the speculators format (the official format has no embedding)")
        head = load_trained_head(workdir, step)
        spec = head.spec
        if spec.head.has_future:
            warn(f"{workdir} holds a {spec.head.variant!r} head; exporting its EAGLE-3 part only. Serving engines "
                 "(SGLang, vLLM) have no contemplate tokens, so the future path (soft prompts, MoE_con, MoE_f) is "
                 "dropped and the exported draft runs without the future entry it was trained with: expect a lower "
                 "acceptance length there than ConFu has here.")
        spec, draft = eagle3_part(spec, head.trainable)
        record = read_target_record(workdir) or {}
        embed = None
        if embed_from:
            from confu_jax.weights import load_model

            cfg, params = load_model(embed_from)
            check_head_target(head, workdir, cfg, params, embed_from)
            embed = np.asarray(params["embed"]["embedding"])
        written = export_head(out, fmt, spec, draft, head.draft_vocab["d2t"], head.draft_vocab["t2d"], dtype=dtype,
                              verifier=verifier or record.get("source"), embed=embed)
        with open(os.path.join(written, "config.json")) as f:
            n_keys = len(json.load(f))
        return (f"exported {workdir} (step {head.step}, {spec.head.variant} part) to {written} in the {fmt} format "
                f"({n_keys} config keys, taps {list(spec.taps)}, draft vocab {spec.head.draft_vocab_size})")

    return write


def _write_medusa(workdir, out, *, step=None, dtype=None, target, target_source, warn=log.warning) -> str:
    from confu_jax.runs.medusa import export_medusa_run

    run = export_medusa_run(workdir, out, *target, step=step, dtype=_dtype_text(dtype), target_source=target_source)
    return (f"exported {workdir} (step {run.step}, Medusa heads) to {out} in the FasterDecoding format "
            f"(medusa_lm_head.safetensors + config.json, {_dtype_text(dtype)})")


def _write_mlp_speculator(workdir, out, *, step=None, dtype=None, target, target_source, warn=log.warning) -> str:
    from confu_jax.runs.mlp_speculator import export_mlp_speculator_run

    run = export_mlp_speculator_run(workdir, out, *target, step=step, dtype=_dtype_text(dtype),
                                    target_source=target_source)
    c = run.config
    return (f"exported {workdir} (step {run.step}, MLP speculator: {c.n_predict} stages, inner_dim {c.inner_dim}"
            f"{', tied' if c.tie_weights else ''}{', scale_input' if c.scale_input else ''}) to {out} in the "
            f"mlp_speculator format (model.safetensors + config.json, {_dtype_text(dtype)})")


def _write_mtp(workdir, out, *, step=None, dtype=None, target, target_source, warn=log.warning,
               mtp_shared=False) -> str:
    from confu_jax.runs.mtp import export_mtp_run

    run = export_mtp_run(workdir, out, *target, step=step, dtype=_dtype_text(dtype), include_shared=mtp_shared,
                         target_source=target_source)
    return (f"exported {workdir} (step {run.step}, MTP module: layer model.layers.{target[0].n_layers}"
            f"{', with the shared embedding / LM head' if mtp_shared else ''}) to {out} in the mtp format "
            f"(DeepSeek-V3 names; model.safetensors + config.json, {_dtype_text(dtype)})")


def _write_dflash(workdir, out, *, step=None, dtype=None, target, target_source, warn=log.warning) -> str:
    from confu_jax.runs.dflash import export_dflash_run

    run = export_dflash_run(workdir, out, *target, step=step, dtype=_dtype_text(dtype), target_source=target_source)
    return (f"exported {workdir} (step {run.step}, DFlash: {run.draft.n_layers} layers over target layers "
            f"{[t - 1 for t in run.taps]}, block {run.block_size}, mask {run.mask_token_id}) to {out} in the "
            f"dflash format (DFlashDraftModel; model.safetensors + config.json, {_dtype_text(dtype)})")


EXPORT_FORMATS: dict = {f.name: f for f in (
    ExportFormat(name="eagle3", write=_write_head("eagle3"), reads_target=False, options=("verifier",),
                 help="official EAGLE-3 layout (SGLang, SpecForge)"),
    ExportFormat(name="speculators", write=_write_head("speculators"), reads_target=False,
                 options=("verifier", "embed_from"), help="vLLM's speculators format"),
    ExportFormat(name="medusa", write=_write_medusa, reads_target=True,
                 help="FasterDecoding's medusa_lm_head.safetensors + config.json (a Medusa run)"),
    ExportFormat(name="mlp_speculator", write=_write_mlp_speculator, reads_target=True,
                 help="fms-extras / vLLM model.safetensors + config.json (an MLP speculator run)"),
    ExportFormat(name="mtp", write=_write_mtp, reads_target=True, options=("mtp_shared",),
                 help="DeepSeek-V3's MTP layer names around a Llama layer (an MTP run)"),
    ExportFormat(name="dflash", write=_write_dflash, reads_target=True,
                 help="z-lab's DFlashDraftModel model.safetensors + config.json (a DFlash run)"),
)}

