"""Medusa-1 heads as a ``Drafter`` (docs/DESIGN.md §11 "Medusa"; heads: ``models.medusa``).

Why it is its own family: Medusa drafts from **one vector**. Head k reads the target's final-normed
hidden state h[p] at the last accepted position p and predicts x[p+k+2]; the root of the tree is
the bonus x[p+1] (predicted by the target itself from the same h[p]), so the depth-(k+1) nodes are
head k's guesses. Heads never see the tokens they are stacked on: every node at one depth gets the
same distribution, whatever its parent — no draft KV cache, no recurrence, one batched matmul per
ResBlock layer per round.

**State** (``MedusaState``): ``hidden_bd`` = h[p]. ``init`` takes it from the prefill (the last
prompt token, ``PrefillView.last_hidden_bd``); ``update`` from the verification pass at the last
accepted node (``VerifyOutput.hidden_btd[ver.last_node_b]``, whose logits gave the bonus), so the
heads cost nothing on the target side: the hidden state is computed by every verification anyway.

**Trees** (``plan``, depth D ≤ the number of heads):

* ``chain:K``: head i's top-1 at depth i+1;
* ``sampled_chain:K`` (T > 0): node i+1 drawn from q_i = head i's distribution after the target's
  temperature / top-p (``decode.tree.draft_sampled_chain``), verified by Leviathan's rule;
* ``static`` trees (Medusa's "choices" paths; text ``tree:k1,k2,...,kD`` = the Cartesian product of
  head i's top-k_i, Medusa-1's original tree; ``plans.StaticTree.cartesian`` builds it): a node of rank r at
  depth d+1 is head d's r-th token, under every parent;
* ``dynamic:D,K,N`` (EAGLE-2's selection by cumulative head log-probability) also works, since the
  tree drafters only ask for the log-probabilities below each frontier node.

Verification is the project's exact rules (§4): greedy equality, sequential residual sampling for
deterministic trees, Leviathan for sampled chains. Medusa's "typical acceptance" (lossy) is not
implemented.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode.drafter import (DraftInput, PlanDrafter, PrefillView, Proposal, VerifiedPass, full_proposal,
                                     last_accepted_hidden)
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models.medusa import config_of, medusa_logits
from confu_jax.models.vocab_map import to_target_vocab

MEDUSA_FORMS = "chain:K, sampled_chain:K, dynamic:D,K,N or tree:k1,...,kD (top-k_i of head i, Cartesian)"


@flax.struct.dataclass
class MedusaState:
    hidden_bd: jax.Array  # [B, d] the target's final-normed hidden state at p (the last accepted position)


def medusa_params(params) -> dict:
    heads = (params.draft or {}).get("medusa")
    if heads is None:
        raise ValueError("a Medusa drafter needs params.draft['medusa'] (models.medusa.init_medusa, a trained "
                         "configs/*_medusa.py workdir, or an imported FasterDecoding head: decode.families.decode_head)")
    return heads


def parse_medusa_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (no ``+cM``)."""
    return parse_plan(text, what="Medusa", forms=MEDUSA_FORMS)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(PlanDrafter):
    """Medusa-1 heads drafting the trees of ``plan`` (module docstring)."""

    plan: DraftPlan
    what = "Medusa heads"

    def init(self, spec, params, view: PrefillView) -> MedusaState:
        if view.last_hidden_bd is None:
            raise ValueError("MedusaDrafter.init needs PrefillView.last_hidden_bd (the target's last hidden state)")
        return MedusaState(hidden_bd=view.last_hidden_bd.astype(jnp.float32))

    def propose(self, spec, params, st: MedusaState, inp: DraftInput) -> Proposal:
        heads = medusa_params(params)
        c = config_of(heads)
        depth = self.max_depth
        if depth > c.num_heads:
            raise ValueError(f"plan {self.describe()!r} drafts {depth} deep; these Medusa heads predict only "
                             f"{c.num_heads} tokens ahead (depth <= medusa_num_heads)")
        sub = jax.tree_util.tree_map(lambda x: x[:depth], heads)  # only the heads the tree reaches
        logits_kbv = to_target_vocab(medusa_logits(sub, st.hidden_bd), spec.target.vocab_size)
        logp_kbv = jax.nn.log_softmax(logits_kbv, axis=-1)

        def expand_fn(s, fr: tree_lib.Frontier):
            n = fr.tokens_bk.shape[1]
            lp = logp_kbv[fr.depth][:, None, :]
            return jnp.broadcast_to(lp, (lp.shape[0], n, lp.shape[-1])), s

        tree, q, _ = self.draft(expand_fn, None, inp)
        return full_proposal(tree, q, st)

    def update(self, spec, params, st: MedusaState, v: VerifiedPass) -> MedusaState:
        """h[p'] at the new last accepted position p' = the last accepted node of the pass."""
        return st.replace(hidden_bd=last_accepted_hidden(v, st.hidden_bd, "MedusaDrafter"))
