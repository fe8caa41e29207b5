"""What a method loads beside the target (``LoadedDrafter``), whatever its family: trained weights, an
initialisation, a draft model, or nothing (model-free drafters). Each family's loader lives in its own
module (``DrafterFamily.load``; ``decode.families`` is the list); this module holds what they share:
the result type, the target alone, a released head's hash and target check, and ``WORKDIR@STEP``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from confu_jax.decode.params import DrafterParams, Target
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.runs.head_release import is_head_release, verify_head_release
from confu_jax.runs.heads import target_fingerprint


class LoadedDrafter(NamedTuple):
    """A family's loaded drafter beside the target: ``target`` and ``drafter_params`` are what
    ``decode.loop.generate_speculative`` takes (with the drafter ``decode.families.drafter_for`` parses)."""

    target: Target
    drafter_params: DrafterParams
    trained: bool
    source: str  # the workdir, or 'random (seed N)'

    @property
    def spec(self) -> ModelSpec:
        """The static description the model functions and cost models read (derived, never stored)."""
        return self.drafter_params.spec(self.target.config)


def model_free(target_cfg: LlamaConfig, target_params: dict) -> LoadedDrafter:
    """What a model-free drafter (prompt lookup) decodes with: the target alone (no head)."""
    return own_weights(target_cfg, target_params, {}, True, "model-free (no head)")


def own_weights(target_cfg: LlamaConfig, target_params: dict, draft: dict, trained: bool, source: str, *,
                draft_model: Optional[LlamaConfig] = None, tap_layers: Optional[tuple] = None) -> LoadedDrafter:
    """A family's own weights ``draft`` (``{family: tree}``; {} for none) beside the target; ``draft_model`` /
    ``tap_layers``: a draft model's architecture and the taps it reads, where the family has them."""
    dp = DrafterParams(weights=draft, draft_vocab={}, draft_model=draft_model, tap_layers=tap_layers)
    return LoadedDrafter(Target(target_cfg, target_params), dp, trained, source)


def head_weights(target_cfg: LlamaConfig, target_params: dict, head: HeadConfig, trainable: dict,
                 draft_vocab: dict, trained: bool, source: str) -> LoadedDrafter:
    """A head (EAGLE-3 / ConFu / P-EAGLE) from its training tree ``{'draft': ..., 'confu': ...}`` and its
    vocabulary maps, beside the target."""
    return LoadedDrafter(Target(target_cfg, target_params), DrafterParams.for_head(head, trainable, draft_vocab),
                         trained, source)


def check_release(directory: str, target_params) -> None:
    """A released head (releases/heads/...): its files' hashes and its target, before loading."""
    if not is_head_release(directory):
        return
    manifest = verify_head_release(directory)
    want = (manifest.get("target") or {}).get("fingerprint")
    if want and want != target_fingerprint(target_params):
        raise ValueError(f"{directory} was trained against a target with weights fingerprint {want[:16]}... "
                         f"({manifest['target'].get('source')}); the loaded target differs")


def split_step(source: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """``runs/e3@64`` -> ('runs/e3', 64): a head source naming one checkpoint step of a training
    run (the points of a scaling curve; a run's latest step otherwise). A path whose last '@' is not
    followed by digits alone is returned whole."""
    if not source or "@" not in source:
        return source, None
    path, _, tail = source.rpartition("@")
    if not tail.isdigit() or not path:
        return source, None
    return path, int(tail)
