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
  head i's top-k_i, Medusa-1's original tree; ``static_choices`` builds it): a node of rank r at
  depth d+1 is head d's r-th token, under every parent;
* ``dynamic:D,K,N`` (EAGLE-2's selection by cumulative head log-probability) also works, since the
  tree drafters only ask for the log-probabilities below each frontier node.

Verification is the project's exact rules (§4): greedy equality, sequential residual sampling for
deterministic trees, Leviathan for sampled chains. Medusa's "typical acceptance" (lossy) is not
implemented.
"""

from __future__ import annotations

import dataclasses
import itertools

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
                         "configs/*_medusa.py workdir, or an imported FasterDecoding head: decode.heads.decode_head)")
    return heads


def cartesian_paths(top_ks) -> tuple:
    """Medusa-1's Cartesian tree: every path (r_1..r_d), d ≤ D, r_i < top_ks[i-1]."""
    paths = []
    for d in range(1, len(top_ks) + 1):
        paths.extend(itertools.product(*[range(k) for k in top_ks[:d]]))
    return tuple(tuple(p) for p in paths)


def parse_cartesian_plan(text: str, what: str, forms: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (the Cartesian tree
    of per-depth top-k, ``cartesian_paths``; no ``+cM``), for the drafters whose depth-d guesses
    come from their own d-th head or stage (Medusa, the MLP speculator). ``what`` names the family
    in errors, ``forms`` lists what it accepts."""
    kind, _, arg = text.partition(":")
    if kind == "tree":
        try:
            ks = tuple(int(x) for x in arg.split(","))
        except ValueError:
            raise ValueError(f"bad {what} plan {text!r}: expected {forms}") from None
        if not ks or min(ks) < 1:
            raise ValueError(f"bad {what} plan {text!r}: tree:k1,...,kD needs every k_i >= 1")
        return DraftPlan("static", paths=cartesian_paths(ks))
    plan = parse_plan(text)
    if plan.contemplates:
        raise ValueError(f"{what} has no contemplates: {text!r} (drop +cM)")
    return plan


def describe_cartesian(plan: DraftPlan) -> str:
    """The text ``parse_cartesian_plan`` reads back: ``tree:k1,...`` for a Cartesian static tree."""
    if plan.kind == "static":
        paths = tuple(tuple(q) for q in plan.paths)
        ks = tuple(1 + max(q[i] for q in paths if len(q) > i) for i in range(max(map(len, paths))))
        if sorted(cartesian_paths(ks)) == sorted(paths):
            return "tree:" + ",".join(map(str, ks))
        return f"static:{list(paths)}"
    return plan.text


def parse_medusa_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (no ``+cM``)."""
    return parse_cartesian_plan(text, "Medusa", MEDUSA_FORMS)


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(PlanDrafter):
    """Medusa-1 heads drafting the trees of ``plan`` (module docstring)."""

    plan: DraftPlan
    what = "Medusa heads"

    def describe(self) -> str:
        return describe_cartesian(self.plan)

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
