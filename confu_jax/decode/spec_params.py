"""The parameters the speculative loop reads, as one typed pytree.

Three trees are kept apart on purpose (docs/DESIGN.md §2): the frozen target (never trained,
never donated), the trainable head (``draft`` and ConFu's target-side ``confu`` extras, exactly
the tree ``models.params.init_trainable`` builds and training checkpoints), and the draft
vocabulary maps (not trainable). The draft reads the target's token embeddings; they are taken
from ``target`` (``embed_vd``), not stored twice.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

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
