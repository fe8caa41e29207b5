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
from typing import Any, Callable, Optional

from confu_jax import storage
from confu_jax.models.llama import LlamaConfig

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


def dtype_text(dtype: Optional[str]) -> str:
    return dtype or "float32"


def target_dtype(target_source: Optional[str]) -> Optional[str]:
    """The float dtype a serving engine runs ``target_source`` in (its checkpoint's own: bf16 for a
    bf16 Hugging Face directory, float32 for a dequantised GGUF), read from its metadata alone; None
    when there is no source or it cannot be read here. An export defaults to it: SGLang's
    ``--dtype auto`` takes the draft's dtype from its ``config.json``, and a float32 draft beside a
    bf16 target becomes float16 there."""
    if not target_source:
        return None
    from confu_jax.assets import strip_asset
    from confu_jax.weights import read_architecture

    try:
        return read_architecture(strip_asset(target_source)).param_dtype
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class EagleSource:
    """An EAGLE-3 head (or a ConFu head's EAGLE-3 part) read from any source the project loads, ready
    for ``eagle3_formats.export_head``; ``target_source`` names its target when the source records one."""

    spec: Any
    draft: dict
    d2t: Any
    t2d: Any
    desc: str
    target_source: Optional[str]
    fingerprint: Optional[str] = None  # the target weights' fingerprint the source records


def read_eagle_source(source: str, step: Optional[int] = None, target: Optional[str] = None,
                      warn=log.warning) -> EagleSource:
    """The EAGLE-3 part of the head in ``source``: a ``launch.train`` workdir (EAGLE-3 or ConFu), a
    release (``releases/heads/...``: hashes checked; official layout or ConFu's trainable tree), or a
    published head in the official (SGLang / SpecForge) or speculators (vLLM) layout. A published
    layout does not always say which layers it taps (the official one omits them for the default
    taps, which depend on the target's depth), so it is bound to the target's architecture: ``target``
    (a model source: asset name, Hugging Face directory, .gguf), else the one the release manifest or
    the speculators config names. Only the target's ``config.json`` / GGUF header is read."""
    from confu_jax.assets import strip_asset
    from confu_jax.runs.head_release import is_head_release, verify_head_release
    from confu_jax.runs.heads import load_trained_head, read_target_record
    from confu_jax.weights import read_architecture
    from confu_jax.weights.eagle3_formats import bind_to_target, detect_format, eagle3_part, load_head

    recorded, fingerprint = None, None
    if is_head_release(source):
        manifest_target = verify_head_release(source).get("target") or {}
        recorded, fingerprint = manifest_target.get("source"), manifest_target.get("fingerprint")
    fmt = detect_format(source)
    if fmt is None:
        if not (storage.isfile(os.path.join(source, "config.json"))
                or storage.isfile(os.path.join(source, "export.json"))):
            raise ValueError(f"{source}: not a launch.train workdir (config.json + checkpoints/), a release "
                             "(manifest.json), nor an EAGLE-3 head in the official, speculators or tpu-inference "
                             "layout (config.json with architectures ['LlamaForCausalLMEagle3'] / "
                             "['Eagle3LlamaForCausalLM'] / speculators_model_type)")
        head = load_trained_head(source, step)
        spec = head.spec
        if spec.head.has_future:
            warn(f"{source} holds a {spec.head.variant!r} head; exporting its EAGLE-3 part only. Serving engines "
                 "(SGLang, vLLM) have no contemplate tokens, so the future path (soft prompts, MoE_con, MoE_f) is "
                 "dropped and the exported draft runs without the future entry it was trained with: expect a lower "
                 "acceptance length there than ConFu has here.")
        spec, draft = eagle3_part(spec, head.trainable)
        record = read_target_record(source) or {}
        return EagleSource(spec, draft, head.draft_vocab["d2t"], head.draft_vocab["t2d"],
                           f"{source} (step {head.step}, {spec.head.variant} part)",
                           target or recorded or record.get("source"), fingerprint or record.get("fingerprint"))
    if step is not None:
        raise ValueError(f"--step {step}: {source} is a published {fmt}-layout head, which holds one set of weights")
    imp = load_head(source)
    if fmt == "speculators" and not recorded:
        with storage.open(os.path.join(source, "config.json")) as f:
            import json

            recorded = ((json.load(f).get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    name = target or recorded
    if not name:
        raise ValueError(f"{source}: a {fmt}-layout head names no target; pass --target (the model it drafts for: "
                         "an asset name, a Hugging Face directory or a .gguf file)")
    try:
        arch = read_architecture(strip_asset(name))
    except (OSError, ValueError) as e:
        raise ValueError(f"{source}: cannot read its target {name!r} ({e}); pass --target with the model it drafts "
                         "for") from None
    spec, trainable, vocab = bind_to_target(imp, arch)
    return EagleSource(spec, trainable["draft"], vocab["d2t"], vocab["t2d"], f"{source} ({fmt} layout)", name,
                       fingerprint)


def _write_head(fmt: str):
    """EAGLE-3's official layout or vLLM's speculators format, from any EAGLE-3 or ConFu head the
    project loads (``read_eagle_source``; a ConFu head's EAGLE-3 part: serving engines have no
    contemplate tokens). The stored dtype defaults to the target's (``target_dtype``), else the
    head's own."""

    def write(workdir, out, *, step=None, dtype=None, target=None, target_source="", warn=log.warning,
              embed_from=None, verifier=None, target_model=None) -> str:
        import json

        import numpy as np

        from confu_jax.runs.heads import target_fingerprint
        from confu_jax.weights.eagle3_formats import export_head

        if embed_from and fmt != "speculators":
            raise ValueError("embed_from is for the speculators format (the official format has no embedding)")
        src = read_eagle_source(workdir, step, target_model, warn)
        spec = src.spec
        embed = None
        if embed_from:
            from confu_jax.weights import load_model

            cfg, params = load_model(embed_from)
            want = src.fingerprint
            if want and want != target_fingerprint(params):
                raise ValueError(f"--embed_from {embed_from}: its weights (fingerprint "
                                 f"{target_fingerprint(params)[:16]}...) are not the target {workdir} was trained "
                                 f"against ({want[:16]}...)")
            if cfg.vocab_size != spec.target.vocab_size or cfg.d_model != spec.target.d_model:
                raise ValueError(f"--embed_from {embed_from}: vocabulary x width {cfg.vocab_size} x {cfg.d_model}; "
                                 f"the head drafts for {spec.target.vocab_size} x {spec.target.d_model}")
            embed = np.asarray(params["embed"]["embedding"])
        dtype = dtype or target_dtype(src.target_source)
        written = export_head(out, fmt, spec, src.draft, src.d2t, src.t2d, dtype=dtype,
                              verifier=verifier or src.target_source, embed=embed)
        with storage.open(os.path.join(written, "config.json")) as f:
            n_keys = len(json.load(f))
        stored = dtype or "the head's own dtype"
        return (f"exported {src.desc} to {written} in the {fmt} format ({n_keys} config keys, taps "
                f"{list(spec.taps)}, draft vocab {spec.head.draft_vocab_size}, {stored})")

    return write


# the EAGLE-3 / ConFu head family's formats; every other family declares its own beside its run reader
# (runs/<family>.py), and its drafter record lists them (decode.families.EXPORT_FORMATS is the union)
HEAD_FORMATS = (
    ExportFormat(name="eagle3", write=_write_head("eagle3"), reads_target=False, options=("verifier", "target_model"),
                 help="official EAGLE-3 layout (SGLang, SpecForge)"),
    ExportFormat(name="speculators", write=_write_head("speculators"), reads_target=False,
                 options=("verifier", "embed_from", "target_model"), help="vLLM's speculators format"),
    ExportFormat(name="tpu_inference", write=_write_head("tpu_inference"), reads_target=False,
                 options=("target_model",), help="tpu-inference's JAX EAGLE-3 (vLLM on TPU; Llama targets)"),
)


def speculators_verifier(workdir: str, target_cfg: LlamaConfig, verifier: Optional[str], target_source: str) -> dict:
    """The ``verifier`` / ``verifier_arch`` a speculators-layout export (DSpark's, DFlash2's) names: ``verifier``
    when given, else the run's recorded target source, else the loaded target's; its architecture from the
    target's config."""
    from confu_jax.runs.heads import read_target_record
    from confu_jax.weights.export import model_type_of
    from confu_jax.weights.hf import SUPPORTED_MODEL_TYPES

    record = read_target_record(workdir) or {}
    return {"verifier": verifier or record.get("source") or target_source,
            "verifier_arch": SUPPORTED_MODEL_TYPES[model_type_of(target_cfg)]}
