"""What the hidden-state drafters share: Medusa-1, the MLP speculator and DeepSeek's MTP module draft
from the target's final-normed hidden states and their own weights tree (``DrafterParams.weights[key]``).

Why one module: the three families differ in how they draft (positional heads, recurrent stages, a
cached layer), not in what they keep or how they load. Medusa and the MLP speculator keep one vector
between iterations, h[p] at the last accepted position (``LastHiddenDrafter``: its state, ``init``
from the prefill, ``update`` from the verification pass); all three read their tree from
``DrafterParams.weights`` (``own_tree``) and load it the same way (``load_own_tree``: the reference
initialisation without a source, else the first matching kind of folder, checked against the target).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode.drafter import PlanDrafter, PrefillView, VerifiedPass, last_accepted_hidden
from confu_jax.decode.family import SourceKind, resolve_source
from confu_jax.decode.loaded import LoadedDrafter, own_weights


@flax.struct.dataclass
class LastHiddenState:
    hidden_bd: jax.Array  # [B, d] the target's final-normed hidden state at p (the last accepted position)


@dataclasses.dataclass(frozen=True)
class LastHiddenDrafter(PlanDrafter):
    """A plan drafter whose state is h[p] alone (Medusa, the MLP speculator): the subclass drafts."""

    def init(self, target, dp, view: PrefillView) -> LastHiddenState:
        """h[p] of the prompt's last token."""
        if view.last_hidden_bd is None:
            raise ValueError(f"{type(self).__name__}.init needs PrefillView.last_hidden_bd (the target's last "
                             "hidden state)")
        return LastHiddenState(hidden_bd=view.last_hidden_bd.astype(jnp.float32))

    def update(self, target, dp, st: LastHiddenState, v: VerifiedPass) -> LastHiddenState:
        """h[p'] at the new last accepted position p' = the last accepted node of the pass."""
        return st.replace(hidden_bd=last_accepted_hidden(v, st.hidden_bd, type(self).__name__))


def own_tree(dp, key: str, who: str, sources: str) -> dict:
    """``dp.weights[key]``, or an error naming what drafts with it (``who``) and where such weights come
    from (``sources``)."""
    tree = (dp.weights or {}).get(key)
    if tree is None:
        raise ValueError(f"{who} needs drafter_params.weights[{key!r}] ({sources}: decode.families.decode_head)")
    return tree


def load_own_tree(target_cfg, target_params: dict, key: str, source: Optional[str], *,
                  untrained: Callable[[], tuple], kinds: Sequence[SourceKind],
                  check: Optional[Callable[[dict], None]] = None, check_untrained: bool = False) -> LoadedDrafter:
    """``{key: tree}`` beside the target: with no ``source``, ``untrained() -> (tree, description)`` (the
    reference initialisation, ``trained`` False); else what the first matching kind of folder reads,
    ``(tree, description)``. ``check(tree)`` refuses a tree this target cannot run (on loaded trees, and on
    the untrained one too with ``check_untrained``)."""
    if source is None:
        tree, desc = untrained()
        trained = False
    else:
        tree, desc = resolve_source(source, kinds)
        trained = True
    if check is not None and (trained or check_untrained):
        check(tree)
    return own_weights(target_cfg, target_params, {key: tree}, trained, desc)
