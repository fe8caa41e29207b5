"""Hybrid drafting: prompt lookup where it finds a match, a trained head elsewhere, per row and
per iteration (docs/DESIGN.md §11).

Lookup is free and, where the text copies, often right for several tokens; a head accepts a little
everywhere. Both draft a chain of k tokens every iteration (the head must ingest every accepted
entry anyway, so it runs regardless); each row verifies the lookup chain if its history had a
match of at least ``lookup.min_match`` tokens, else the head's. Both are deterministic drafts, so the
greedy and sequential-residual rules stay exact, and ConFu heads keep their contemplates (the
contemplates read the head's h_cat[p] whatever drafted the nodes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode import cpu_packing
from confu_jax.decode.drafter import DraftInput, Drafter, PrefillView, Proposal, VerifiedPass
from confu_jax.decode.drafting import HeadDrafter, load_head_weights, parse_head
from confu_jax.decode.family import DrafterFamily, Method
from confu_jax.decode.lookup import PromptLookup
from confu_jax.decode.plans import Chain


@flax.struct.dataclass(kw_only=True)
class HybridState:
    head: Any  # drafting.HeadDraftState
    lookup: Any  # lookup.LookupState


@dataclasses.dataclass(frozen=True)
class Hybrid(Drafter):
    head: HeadDrafter
    lookup: PromptLookup

    def __post_init__(self):
        plan = self.head.plan
        if not isinstance(plan, Chain) or plan.contemplates:
            raise ValueError(f"Hybrid drafts chains: the head's plan must be chain:K, got {plan.text}")
        if self.lookup.branches != 1 or self.lookup.k != plan.k:
            raise ValueError(f"Hybrid needs a one-branch lookup of the head's depth {plan.k}; got "
                             f"k={self.lookup.k}, branches={self.lookup.branches}")

    @property
    def max_depth(self) -> int:
        return self.head.max_depth

    @property
    def n_nodes(self) -> int:
        return self.head.n_nodes

    @property
    def widths(self) -> tuple:
        """The head's widths (1..T with a confidence-gated head: an iteration where lookup found
        nothing and the head is unsure verifies the root alone)."""
        return self.head.widths

    def init(self, target, dp, view: PrefillView) -> HybridState:
        return HybridState(head=self.head.init(target, dp, view), lookup=self.lookup.init(target, dp, view))

    def propose(self, target, dp, st: HybridState, inp: DraftInput) -> Proposal:
        hp = self.head.propose(target, dp, st.head, inp)
        lp = self.lookup.propose(target, dp, st.lookup, inp)
        use = lp.n_nodes_b > 1  # lookup found a match for this row

        def pick(x_lookup, x_head):
            return jnp.where(use.reshape((-1,) + (1,) * (x_head.ndim - 1)), x_lookup, x_head)

        tree = jax.tree_util.tree_map(pick, lp.tree, hp.tree)
        return Proposal(tree, None, jnp.where(use, lp.n_nodes_b, hp.n_nodes_b), hp.verify_inputs,
                        HybridState(head=hp.state, lookup=lp.state))

    def update(self, target, dp, st: HybridState, v: VerifiedPass) -> HybridState:
        return HybridState(head=self.head.update(target, dp, st.head, v),
                           lookup=self.lookup.update(target, dp, st.lookup, v))

    def describe(self) -> str:
        """The head's plan text (``chain:K`` or ``chain:K@P``): the lookup follows from it."""
        return self.head.describe()


# ----------------------------------------------------------------------------- the family


def parse_hybrid(text: str) -> Hybrid:
    head = parse_head(text)
    if not isinstance(head.plan, Chain) or head.plan.contemplates:
        raise ValueError(f"hybrid decoding drafts chains (chain:K or chain:K@P); got {text!r}")
    return Hybrid(head=head, lookup=PromptLookup(k=head.plan.k))


cpu_packing.register(Hybrid, lambda d: cpu_packing.packable_draft(d.head))  # its head's, packed as the head's

FAMILIES = (DrafterFamily(
    "hybrid", parse_hybrid, load_head_weights,
    methods=(Method("hybrid", ("eagle3", "confu", "confu_nomoe", "confu_nomoe_norep"),
                    "prompt lookup where it matches, the head (EAGLE-3 or ConFu) elsewhere, per row"),),
    trees=(), reads_step=True),)
