"""What the speculative loop takes besides the drafter: the target and the drafter's parameters, as
typed pytrees — the loop's one parameter form (``decode.loop.generate_speculative(target, drafter,
drafter_params, prompts)``).

Three trees are kept apart on purpose (docs/DESIGN.md §2): the frozen target (``Target``: never
trained, never donated), the drafter's weights (``DrafterParams.weights``: for a head exactly the
``draft`` tree ``models.params.init_trainable`` builds and training checkpoints, ``{family: tree}``
for the other families) with ConFu's target-side verification extras beside them
(``DrafterParams.verify_params``), and the draft vocabulary maps (not trainable). Each carries its own
architecture as static fields — a jit argument's structure, not a traced leaf — so a program is
traced once per (target, drafter architecture) and never from a second description of either.
The draft reads the target's token embeddings from ``Target`` (``embed_vd``), not a second copy.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax

from confu_jax.models.llama import LlamaConfig
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.models.target import embedding_table


@flax.struct.dataclass
class Target:
    """The frozen target as the loop takes it: its architecture (static) and its weights (the stacked
    Llama tree ``weights.load_model`` returns; inside the CPU loop, ``models.unrolled.SplitParams``)."""

    config: LlamaConfig = flax.struct.field(pytree_node=False)
    params: Any

    @property
    def embed_vd(self) -> jax.Array:
        """[V, d] the target's token embeddings (a head's input embeddings)."""
        return embedding_table(self.params)


@flax.struct.dataclass
class DrafterParams:
    """What a drafter drafts with: its own architecture (static fields) and its parameter tree.

    ``head``: an EAGLE-3 / ConFu / P-EAGLE head's config (None for every other family);
    ``draft_model``: an independent draft model's or a block drafter's architecture; ``tap_layers``:
    the target layers a headless drafter reads when they are not the target's defaults (DFlash,
    DSpark). ``weights``: the drafter's tree — a head's (fc, attention, MLP, norms, LM head), or
    ``{family: tree}`` for the other families (what each family's loader builds and its ``init``
    reads); ``{}`` for model-free drafters. ``verify_params``: what the target's verification pass reads of
    the drafter besides its tokens (ConFu: the soft prompts and MoE_con its contemplates read), None for a
    drafter whose verification reads nothing. ``draft_vocab``: a
    head's d2t / t2d maps ({} where the drafter drafts in the target's vocabulary)."""

    weights: dict
    draft_vocab: dict
    verify_params: Optional[dict] = None
    head: Optional[HeadConfig] = flax.struct.field(pytree_node=False, default=None)
    draft_model: Optional[LlamaConfig] = flax.struct.field(pytree_node=False, default=None)
    tap_layers: Optional[tuple] = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def for_head(cls, head: HeadConfig, trainable: dict, draft_vocab: dict) -> "DrafterParams":
        """A head's parameters from its training tree ``{'draft': ..., 'confu': ...}`` (what
        ``models.params.init_trainable`` builds and a training checkpoint holds) and its vocab maps."""
        missing = [k for k in ("d2t", "t2d") if k not in draft_vocab]
        if missing or "draft" not in trainable:
            raise ValueError(f"a head's drafter params need trainable['draft'] and draft_vocab['d2t'/'t2d']; got "
                             f"trainable keys {sorted(trainable)} and draft_vocab keys {sorted(draft_vocab)}")
        return cls(weights=trainable["draft"], draft_vocab=draft_vocab,
                   verify_params=trainable.get("confu", {}) if head.has_future else None, head=head)

    def spec(self, target: LlamaConfig) -> ModelSpec:
        """The static description the model functions (``models.target``, ``models.draft``) read, for
        this drafter on ``target``: derived here, never passed beside the parameters."""
        return ModelSpec(target, self.head, self.draft_model, self.tap_layers)

    @property
    def has_future(self) -> bool:
        """Whether verification runs ConFu's contemplates for this drafter."""
        return self.head is not None and self.head.has_future

    @property
    def verify_extras(self) -> dict:
        """What the target's verification pass reads of the drafter: ConFu's extras, {} for the rest."""
        return {} if self.verify_params is None else self.verify_params

    def check(self) -> "DrafterParams":
        """Raise where ConFu's extras and the head disagree (a ConFu head without them, or extras for a
        drafter that runs no contemplates); return self."""
        if self.has_future and self.verify_params is None:
            raise ValueError(f"a {self.head.variant} head's contemplates need drafter_params.verify_params (its soft prompts "
                             "and MoE_con, what decode.families.decode_head loads); got none")
        if not self.has_future and self.verify_params:
            raise ValueError(f"drafter_params.verify_params is set, but this drafter runs no contemplates "
                             f"({self.head.variant if self.head else 'no head'}): ConFu's extras belong to a ConFu "
                             "head")
        return self
