"""The parameters the speculative loop reads, as typed pytrees.

The loop's public form takes ``(target, drafter, drafter_params)``: a ``Target`` (the target's
config and weights) and a ``DrafterParams`` (the drafter's own architecture and parameter tree, ConFu's
verification extras one optional field). Inside, ``join`` turns the pair into the static
``models.spec.ModelSpec`` every program is traced with and one ``SpecParams`` pytree; ``split`` goes back.

Three trees are kept apart on purpose (docs/DESIGN.md §2): the frozen target (never trained,
never donated), the trainable head (``draft`` and ConFu's target-side ``confu`` extras, exactly
the tree ``models.params.init_trainable`` builds and training checkpoints), and the draft
vocabulary maps (not trainable). The draft reads the target's token embeddings; they are taken
from ``target`` (``embed_vd``), not stored twice.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax

from confu_jax.models.llama import LlamaConfig
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.models.target import embedding_table


@flax.struct.dataclass
class SpecParams:
    target: Any  # frozen target params: the stacked Llama tree, or SplitParams inside the loop
    draft: dict  # draft head (fc, attention, MLP, norms, lm_head; moe_f for ConFu)
    confu: dict  # soft prompts + MoE_con; {} for EAGLE-3
    draft_vocab: dict  # {'d2t': int32 [V_draft] target id of each draft id, 't2d': bool [V]}

    @property
    def embed_vd(self) -> jax.Array:
        """[V, d] the target's token embeddings (the draft's input embeddings)."""
        return embedding_table(self.target)


def spec_params(target_params, trainable: dict, draft_vocab: dict) -> SpecParams:
    """From the target, the trainable tree ``{'draft': ..., 'confu': ...}`` and the vocab maps."""
    missing = [k for k in ("d2t", "t2d") if k not in draft_vocab]
    if missing or "draft" not in trainable:
        raise ValueError(f"spec_params: need trainable['draft'] and draft_vocab['d2t'/'t2d']; got trainable "
                         f"keys {sorted(trainable)} and draft_vocab keys {sorted(draft_vocab)}")
    return SpecParams(target=target_params, draft=trainable["draft"], confu=trainable.get("confu", {}),
                      draft_vocab=draft_vocab)


@flax.struct.dataclass
class Target:
    """The frozen target as the loop takes it: its architecture (static: a jit argument's structure,
    not a traced leaf) and its weights (the stacked Llama tree ``weights.load_model`` returns)."""

    config: LlamaConfig = flax.struct.field(pytree_node=False)
    params: Any


@flax.struct.dataclass
class DrafterParams:
    """What a drafter drafts with: its own architecture (static fields) and its parameter tree.

    ``head``: an EAGLE-3 / ConFu head's config (None for every other family); ``draft_model``: an
    independent draft model's or DFlash's architecture; ``tap_layers``: the target layers a headless
    drafter reads when they are not the target's defaults (DFlash). ``weights``: the drafter's tree —
    a head's (fc, attention, MLP, norms, LM head), or ``{family: tree}`` for the other families (what
    ``decode.families``' loaders build and each family's ``init`` reads); ``{}`` for model-free
    drafters. ``confu``: ConFu's verification extras (soft prompts, MoE_con: what the target's
    contemplates read), None for every other drafter. ``draft_vocab``: a head's d2t / t2d maps."""

    weights: dict
    draft_vocab: dict
    confu: Optional[dict] = None
    head: Optional[HeadConfig] = flax.struct.field(pytree_node=False, default=None)
    draft_model: Optional[LlamaConfig] = flax.struct.field(pytree_node=False, default=None)
    tap_layers: Optional[tuple] = flax.struct.field(pytree_node=False, default=None)

    def spec(self, target: LlamaConfig) -> ModelSpec:
        """The static description the loop's programs are traced with, for this drafter on ``target``."""
        return ModelSpec(target, self.head, self.draft_model, self.tap_layers)


def join(target: Target, drafter_params: DrafterParams) -> tuple:
    """(Target, DrafterParams) -> (ModelSpec, SpecParams): what the loop's programs read."""
    if not isinstance(target, Target) or not isinstance(drafter_params, DrafterParams):
        raise TypeError(f"expected (Target, DrafterParams), got ({type(target).__name__}, "
                        f"{type(drafter_params).__name__})")
    dp = drafter_params
    spec = dp.spec(target.config)
    if spec.has_future and dp.confu is None:
        raise ValueError(f"a {spec.head.variant} head's contemplates need drafter_params.confu (its soft prompts and "
                         "MoE_con, what decode.families.decode_head loads); got none")
    if not spec.has_future and dp.confu:
        raise ValueError(f"drafter_params.confu is set, but this drafter runs no contemplates "
                         f"({spec.head.variant if spec.head else 'no head'}): ConFu's extras belong to a ConFu head")
    return spec, SpecParams(target=target.params, draft=dp.weights, confu={} if dp.confu is None else dp.confu,
                            draft_vocab=dp.draft_vocab)


def split(spec: ModelSpec, params: SpecParams) -> tuple:
    """(ModelSpec, SpecParams) -> (Target, DrafterParams), ``join``'s inverse (a training run's spec and
    its ``spec_params`` become what ``decode.loop.generate_speculative`` takes)."""
    dp = DrafterParams(weights=params.draft, draft_vocab=params.draft_vocab,
                       confu=params.confu if spec.has_future else None, head=spec.head,
                       draft_model=spec.draft_model, tap_layers=spec.tap_layers)
    return Target(config=spec.target, params=params.target), dp
