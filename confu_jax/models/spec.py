"""Static description of a (target, draft head) pair: what every model function is traced with.

``ModelSpec`` is hashable (frozen dataclasses all the way down), so it can be a static argument of
``jax.jit``. It is built from an ml_collections config with ``model_spec_from_config``; the config
is the user-facing surface, the spec is what the code reads.

Variants (``HeadConfig.variant``) are listed, with what each has, in ``models.registry``.
The config's ``model.attention_impl`` is resolved here, once, against the backend
(``resolve_attention_impl``: the Pallas kernel needs a GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from confu_jax.kernels.fused_attention import resolve_flash_impl
from confu_jax.kernels.tree_attention import resolve_attention_impl
from confu_jax.models.llama import LlamaConfig
from confu_jax.models.presets import get_preset
from confu_jax.models.registry import VARIANTS, get_variant


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The draft head and ConFu extras. Widths, heads and RoPE come from the target's LlamaConfig."""

    variant: str = "confu"
    draft_vocab_size: int = 32000
    draft_ffn_dim: Optional[int] = None  # None: the target's ffn_dim (EAGLE-3 copies the target's MLP width)
    tap_layers: Optional[tuple] = None  # None: target.default_taps (EAGLE-3's low/mid/high layers)
    n_soft_prompts: int = 16
    n_expert: int = 8
    expert_top_k: int = 2
    init_std: float = 0.02
    soft_prompt_init_std: float = 0.02
    # ConFu only, a departure from the paper (None = the paper): a learned per-head logit added to the
    # draft's attention score of its future entry, starting at this value. The entry joins a trained
    # EAGLE-3 attention with a tiny softmax weight (~0.05% on the release, docs/RESULTS.md "Why ConFu
    # ignores its future"), and a weight near 0 gets a gradient near 0; the bias starts it where training can see it.
    future_bias: Optional[float] = None
    # ConFu only, not the paper's (False = the paper): f also enters the first draft step's input — a
    # learned d x d map of f (zero at init, so the head starts as the paper's) added to the hidden input
    # of step 0's queries and residual stream (not to the keys the draft cache keeps). The draft's loss
    # reaches it directly, not only through the attention the future entry gets (docs/DESIGN.md §4).
    future_input: bool = False
    # ConFu only, not the paper's (False = the paper): f is the contemplate's taps at the EAGLE-3 tap layers
    # ([3d], h_cat of the contemplate) and the draft reads it through its own fc, as it reads every other
    # position, instead of the contemplate's final-normed last layer ([d]) entering the draft as it is.
    # The auxiliary loss and the f diagnostics read the top tap through the target's final norm and LM head.
    future_taps: bool = False
    dtype: str = "float32"  # draft compute dtype
    param_dtype: str = "float32"  # trainable parameters (soft prompts, MoEs, draft)
    # The draft's own RoPE and norms. Our heads use the target's (None / False); a published EAGLE-3
    # head brings its own config (weights/eagle3_formats.py, DESIGN.md §10): e.g. RoPE base 10000
    # under a Llama-3 target whose base is 500000.
    rope_theta: Optional[float] = None  # None: the target's RoPE (rope_theta and rope_scaling)
    rope_scaling: Optional[tuple] = None  # with rope_theta: Llama-3 scaling tuple (LlamaConfig's form) or None
    max_position_embeddings: Optional[int] = None  # the draft config's own; recorded, RoPE runs at any position
    rms_eps: Optional[float] = None  # None: the target's rms_eps
    # speculators' norm-placement flags (all False = EAGLE-3 as published):
    norm_before_residual: bool = False  # the attention residual is hidden_norm(h), not h
    norm_before_fc: bool = False  # one RMSNorm over h_cat (3d) before fc
    fc_norm: bool = False  # an RMSNorm per tapped layer (d each) before fc
    norm_output: bool = False  # the recurrent state is final_norm(h_out); the LM head reads it as is
    # P-EAGLE (variant 'peagle') only: the token whose (target) embedding the parallel slots read
    mask_token_id: Optional[int] = None

    def __post_init__(self):
        if self.rope_scaling is not None and self.rope_theta is None:
            raise ValueError("HeadConfig: rope_scaling needs rope_theta (None means the target's RoPE)")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("HeadConfig: norm_before_fc and fc_norm are mutually exclusive")
        if self.variant not in VARIANTS:
            raise ValueError(f"HeadConfig.variant must be one of {tuple(VARIANTS)}, got {self.variant!r}")
        if self.has_future and self.uses_moe and not 1 <= self.expert_top_k <= self.n_expert:
            raise ValueError(
                f"HeadConfig: expert_top_k must be in [1, n_expert={self.n_expert}], got {self.expert_top_k}"
            )
        if self.future_input and not self.has_future:
            raise ValueError(f"HeadConfig: future_input needs a variant with a future path, got {self.variant!r}")
        if self.future_taps and not self.has_future:
            raise ValueError(f"HeadConfig: future_taps needs a variant with a future path, got {self.variant!r}")
        if self.parallel != (self.mask_token_id is not None):
            raise ValueError(f"HeadConfig: a parallel-drafting variant (P-EAGLE) needs mask_token_id and no other "
                             f"variant takes one; got variant {self.variant!r}, mask_token_id {self.mask_token_id}")
        if self.has_future and self.n_soft_prompts < 0:
            raise ValueError(f"HeadConfig.n_soft_prompts must be >= 0, got {self.n_soft_prompts}")

    @property
    def has_future(self) -> bool:
        """Whether the contemplate/future path exists at all (False only for EAGLE-3)."""
        return get_variant(self.variant).has_future

    @property
    def uses_moe(self) -> bool:
        return get_variant(self.variant).uses_moe

    @property
    def parallel(self) -> bool:
        """P-EAGLE: one pass drafts every depth (``decode.peagle``)."""
        return get_variant(self.variant).parallel


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the loop runs: the target, and the drafter's architecture where it has one. ``head``: an
    EAGLE-3 / ConFu head (None for every other family, whose drafter carries its own configuration
    and reads only the target here); ``draft_model``: an independent draft model's or DFlash's
    architecture; ``tap_layers``: the target layers a headless drafter reads (DFlash), when they are
    not the target's defaults."""

    target: LlamaConfig
    head: Optional[HeadConfig] = None
    # An independent draft model's architecture (drafter family 'draft_model' / SD²,
    # ``decode.draft_model``; DFlash's draft); None for heads and model-free drafters.
    draft_model: Optional[LlamaConfig] = None
    tap_layers: Optional[tuple] = None

    def __post_init__(self):
        taps = self.taps
        if not taps:  # EAGLE-3 / ConFu heads tap 3 layers; DFlash drafters 1 to 5 (z-lab's 8B drafters: 5)
            raise ValueError("ModelSpec: expected at least one tap layer (EAGLE-3 heads: 3), got none")
        for li in taps:
            if not 0 <= li < self.target.n_layers:
                raise ValueError(f"ModelSpec: tap layer {li} outside [0, {self.target.n_layers})")
        if self.head is not None and self.tap_layers is not None:
            raise ValueError("ModelSpec: a head names its tap layers itself (HeadConfig.tap_layers)")
        if self.head is not None and self.head.draft_vocab_size > self.target.vocab_size:
            raise ValueError(
                f"ModelSpec: draft_vocab_size {self.head.draft_vocab_size} exceeds the target vocab "
                f"{self.target.vocab_size}"
            )

    @property
    def taps(self) -> tuple:
        if self.head is not None and self.head.tap_layers is not None:
            return tuple(self.head.tap_layers)
        return tuple(self.tap_layers) if self.tap_layers is not None else self.target.default_taps

    @property
    def has_future(self) -> bool:
        """Whether verification runs contemplates (a ConFu head); False for every other drafter."""
        return self.head is not None and self.head.has_future

    @property
    def d_model(self) -> int:
        return self.target.d_model

    @property
    def draft_ffn_dim(self) -> int:
        return self.head.draft_ffn_dim or self.target.ffn_dim

    @property
    def draft_rope(self) -> LlamaConfig:
        """The LlamaConfig whose RoPE the draft uses: the target's unless the head sets its own."""
        h = self.head
        if h.rope_theta is None:
            return self.target
        return self.target.replace(rope_theta=float(h.rope_theta), rope_scaling=h.rope_scaling)

    @property
    def draft_rms_eps(self) -> float:
        return self.target.rms_eps if self.head.rms_eps is None else float(self.head.rms_eps)


def model_spec_from_config(config, backend: Optional[str] = None) -> ModelSpec:
    """Build the spec from an ml_collections config (``config.model``, ``config.confu``, ``config.draft``).

    ``model.attention_impl`` is checked against ``backend`` (default: JAX's default backend).
    """
    m, c, d = config.model, config.confu, config.draft
    if m.get("dtype", None) is None or d.get("draft_vocab_size", None) is None:
        raise ValueError("config.model.dtype / config.draft.draft_vocab_size are unset: a config without a preset "
                         "is resolved against its checkpoint first (confu_jax.train.target_loading.resolve_target)")
    target = target_from_config(m).replace(
        dtype=m.dtype, param_dtype=m.param_dtype,
        attention_impl=resolve_attention_impl(m.attention_impl, backend),
        flash_impl=resolve_flash_impl(m.get("flash_impl", "xla"), backend),
    )
    head = HeadConfig(
        variant=c.variant,
        draft_vocab_size=int(d.draft_vocab_size),
        draft_ffn_dim=d.get("ffn_dim", None),
        tap_layers=tuple(d.tap_layers) if d.get("tap_layers", None) is not None else None,
        n_soft_prompts=int(c.n_soft_prompts),
        n_expert=int(c.n_expert),
        expert_top_k=int(c.expert_top_k),
        init_std=float(d.init_std),
        soft_prompt_init_std=float(c.soft_prompt_init_std),
        future_bias=_opt(c, "future_bias", float),
        future_input=bool(c.get("future_input", False)),
        future_taps=bool(c.get("future_taps", False)),
        dtype=d.dtype,
        param_dtype=d.param_dtype,
        rope_theta=_opt(d, "rope_theta", float),
        rope_scaling=tuple(d.rope_scaling) if d.get("rope_scaling", None) is not None else None,
        max_position_embeddings=_opt(d, "max_position_embeddings", int),
        rms_eps=_opt(d, "rms_eps", float),
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        fc_norm=bool(d.get("fc_norm", False)),
        norm_output=bool(d.get("norm_output", False)),
        mask_token_id=_opt(d, "mask_token_id", int),
    )
    return ModelSpec(target, head)


def target_from_config(model_section) -> LlamaConfig:
    """The target's architecture: ``model.arch`` (read from the checkpoint when the run started:
    ``train.target_loading.resolve_target``), else the named preset's."""
    arch = model_section.get("arch", None)
    arch = arch.to_dict() if hasattr(arch, "to_dict") else dict(arch or {})
    if arch:
        return LlamaConfig(**{k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in arch.items()})
    if not model_section.get("preset", None):
        raise ValueError("config.model has neither a preset nor an arch: resolve the config against its "
                         "checkpoint first (confu_jax.train.target_loading.resolve_target)")
    return get_preset(model_section.preset)


def _opt(section, key: str, kind):
    """``kind(section[key])``, or None when the key is absent or unset (configs older than the key)."""
    v = section.get(key, None)
    return None if v is None else kind(v)
