"""What a method loads beside the target (``DecodeHead``), whatever its family: trained weights, an
initialisation, a draft model, or nothing (model-free drafters). Each family's loader lives in its own
module (``DrafterFamily.load``; ``decode.families`` is the list); this module holds what they share:
the result type, the target alone, a released head's hash and target check, and ``WORKDIR@STEP``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from confu_jax.decode.spec_params import DrafterParams, SpecParams, Target, split
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.spec import ModelSpec
from confu_jax.runs.head_release import is_head_release, verify_head_release
from confu_jax.runs.heads import target_fingerprint


class DecodeHead(NamedTuple):
    """A family's loaded drafter weights beside the target: ``target`` and ``drafter_params`` are what
    ``decode.loop.generate_speculative`` takes; ``spec`` / ``params`` the joined form
    (``spec_params.join``) a cost model or a training run reads."""

    spec: ModelSpec
    params: SpecParams  # target + trainable + draft vocab
    trained: bool
    source: str  # the workdir, or 'random (seed N)'

    @property
    def target(self) -> Target:
        return split(self.spec, self.params)[0]

    @property
    def drafter_params(self) -> DrafterParams:
        return split(self.spec, self.params)[1]


def model_free(target_cfg: LlamaConfig, target_params: dict) -> DecodeHead:
    """What a model-free drafter (prompt lookup) decodes with: the target alone (no head)."""
    return own_weights(target_cfg, target_params, {}, True, "model-free (no head)")


def own_weights(target_cfg: LlamaConfig, target_params: dict, draft: dict, trained: bool, source: str, *,
                draft_model: Optional[LlamaConfig] = None, tap_layers: Optional[tuple] = None) -> DecodeHead:
    """A family's own weights ``draft`` (``{family: tree}``; {} for none) beside the target; ``draft_model`` /
    ``tap_layers``: a draft model's architecture and the taps it reads, where the family has them."""
    spec = ModelSpec(target_cfg, draft_model=draft_model, tap_layers=tap_layers)
    return DecodeHead(spec, SpecParams(target=target_params, draft=draft, confu={}, draft_vocab={}), trained, source)


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
