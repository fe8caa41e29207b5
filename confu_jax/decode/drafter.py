"""The ``Drafter`` interface: what every drafter family gives the speculative loop (docs/DESIGN.md §11).

The loop (``decode.loop``) owns the target: prefill, the verification pass, the lossless rule, the
KV-cache commit, emission and stopping. A drafter owns everything else, in three pure functions of
its own state (a pytree it defines, carried in ``SpecState.drafter``), each reading the loop's two
parameter trees (``decode.params``): ``target`` (a ``Target``: the target's config and weights) and
``dp`` (a ``DrafterParams``: the drafter's own architecture as static fields, its weights, ConFu's
extras, its vocabulary maps):

* ``init(target, dp, view)`` after the target's prefill (``PrefillView``: the prompt, the first
  emitted token, the prompt's target features);
* ``propose(target, dp, state, inp)`` → ``Proposal``: a ``DraftTree`` rooted at the bonus token
  (``inp.root_b``), the draft distributions q where the sampled-chain rule needs them, how many of
  the tree's leading nodes are worth verifying per row, and for ConFu the contemplate inputs of the
  verification pass;
* ``update(target, dp, state, v)`` after verification (``VerifiedPass``): ingest the accepted
  tokens and, where the family uses them, the target's hidden states of the accepted nodes.

A drafter is a frozen, hashable dataclass — a static argument of the jitted loop, like gemma's
sampling methods: its fields are its configuration (depth, branching, match lengths, compiled pass
widths), never mode strings. Families: ``decode.drafting.HeadDrafter`` (EAGLE-3 / ConFu heads),
``decode.lookup.PromptLookup`` (model-free n-gram lookup), ``decode.hybrid.Hybrid`` (lookup where it
matches, a head elsewhere). ``decode.families`` maps a method name and a plan text to one.

**Pass widths.** ``widths`` lists the verification widths the loop compiles (ascending, the last =
the full tree). Each iteration the loop verifies only the smallest width that holds every active
row's ``n_nodes_b`` leading nodes (``lax.switch`` between compiled branches), so an iteration in
which a model-free drafter found nothing costs one AR step instead of a full-width pass. Trees
must list the nodes a row wants verified first (nodes past ``n_nodes_b`` are dropped).
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.decode import verify as verify_lib
from confu_jax.decode.tree import DraftTree


class PrefillView(NamedTuple):
    """What a drafter's ``init`` sees after the target's prefill (B rows, prompt bucket width W)."""

    tokens_bt: jax.Array  # [B,W] int32 right-padded prompts
    lengths_b: jax.Array  # [B] int32 true prompt lengths n (p = n-1 after prefill)
    first_b: jax.Array  # [B] int32 the first emitted token x[n]: the root of the first tree
    h_cat_btc: jax.Array  # [B,W,3d] the target's taps at every prompt position
    future_bd: Optional[jax.Array]  # [B,F] f of the prefill contemplate (ConFu specs; F = d, 3d with future_taps), else None
    max_len: int  # S: target cache slots (positions 0..S-1)
    last_hidden_bd: Optional[jax.Array] = None  # [B,d] the target's final-normed hidden state at position n-1
    hidden_btd: Optional[jax.Array] = None  # [B,W,d] the target's final-normed hidden states of the prompt


class DraftInput(NamedTuple):
    """Per-iteration inputs of ``propose`` besides the drafter's own state."""

    root_b: jax.Array  # [B] int32 the bonus token x[p+1]: node 0 of the tree
    anchor_b: jax.Array  # [B] int32 p, the last accepted position (target cache length - 1)
    done_b: jax.Array  # [B] bool rows that stopped (they ride along; nothing they draft is used)
    key: jax.Array  # PRNG key of this iteration's drafting
    temperature: jax.Array  # [] float32 (sampled chains draw from q at this temperature)
    top_p: jax.Array  # [] float32


class Proposal(NamedTuple):
    tree: DraftTree  # [B,T] nodes, node 0 = the root
    q_btv: Optional[jax.Array]  # [B,T,V] draft distributions (sampled chains only), else None
    n_nodes_b: jax.Array  # [B] int32 leading nodes worth verifying (1 = nothing drafted: an AR step)
    # the family's own inputs to the target's verification pass, which the loop passes through without reading
    # them: None, or a NamedTuple of ``models.target.verify`` keyword arguments with ``truncated(width)`` (the
    # inputs for the tree's first ``width`` nodes, or an error); ConFu's: ``drafting.ContemplateInputs``
    verify_inputs: Any
    state: Any  # the drafter's state after drafting (e.g. its KV cache after ingestion)


class VerifiedPass(NamedTuple):
    """One verification's outcome, as ``update`` sees it (T' = the width actually verified)."""

    tree: DraftTree  # the verified tree, truncated to T' nodes
    verification: Any  # decode.verify.Verification: path, n_accepted (root incl.), bonus, emitted
    target: Any  # models.target.VerifyOutput: logits, h_cat [B,T',3d], ConFu futures, node K/V
    verify_inputs: Any  # the proposal's (``Proposal.verify_inputs``), as verified
    active_b: jax.Array  # [B] bool rows that were still decoding (only they may change)
    anchor_b: jax.Array  # [B] int32 p before the pass; the new p is p + n_accepted


class Drafter(abc.ABC):
    """Base of every drafter family (subclasses are frozen dataclasses; see the module docstring)."""

    @property
    @abc.abstractmethod
    def max_depth(self) -> int:
        """D: the deepest node a tree may have (the loop reserves D+1 cache slots per pass)."""

    @property
    @abc.abstractmethod
    def n_nodes(self) -> int:
        """T: nodes of a full tree, root included."""

    @property
    def widths(self) -> tuple:
        """Verification widths the loop compiles, ascending; the last is ``n_nodes``."""
        return (self.n_nodes,)

    def rule(self, greedy: bool) -> verify_lib.AcceptanceRule:
        """The lossless acceptance rule (``decode.verify``) for this drafter's trees."""
        return verify_lib.GREEDY if greedy else verify_lib.SAMPLED_TREE

    def prepare_params(self, target, dp):
        """``dp`` (a ``DrafterParams``) as the loop body reads it, computed once per generation outside
        the ``while_loop`` (after the loop laid out the target, e.g. split into per-layer buffers on
        the unrolled CPU path). A drafter with weights of its own re-lays them here to match, so the
        loop body does not redo it every iteration; the default keeps ``dp`` as it is."""
        del target
        return dp

    @abc.abstractmethod
    def init(self, target, dp, view: PrefillView) -> Any:
        """The drafter state after the prompt (a pytree of device arrays with shape-lettered names)."""

    @abc.abstractmethod
    def propose(self, target, dp, state, inp: DraftInput) -> Proposal:
        """Draft one tree per row."""

    @abc.abstractmethod
    def update(self, target, dp, state, v: VerifiedPass) -> Any:
        """Ingest the accepted tokens (rows with ``v.active_b`` false must keep their state)."""

    def describe(self) -> str:
        """The plan text this drafter parses from (``decode.families.parse_drafter``)."""
        return repr(self)


class PlanDrafter(Drafter):
    """A drafter whose trees are one ``decode.plans.DraftPlan`` (field ``plan`` of the subclass
    dataclass): its depth, width, verification rule and plan text follow from the plan. Heads,
    draft models, Medusa heads, the MLP speculator, MTP and DFlash; ``what`` names the family in
    errors. Only a family with ``contemplates`` (ConFu's heads) takes a plan's ``+cM``."""

    what = "this drafter"
    contemplates = False

    def __post_init__(self):
        if self.plan.contemplates and not self.contemplates:
            raise ValueError(f"{self.what} has no contemplates: plan {self.plan.text!r} (drop +cM)")

    @property
    def max_depth(self) -> int:
        return self.plan.max_depth

    @property
    def n_nodes(self) -> int:
        return self.plan.n_nodes_total

    def rule(self, greedy: bool) -> verify_lib.AcceptanceRule:
        return self.plan.rule(greedy)

    def describe(self) -> str:
        return self.plan.text

    def draft(self, expand_fn, state, inp: DraftInput):
        """The plan's tree grown by ``expand_fn`` (``decode.tree``'s contract) -> (tree, q_btv or
        None, the expansion state after drafting)."""
        tree, q, _, state = self.plan.grow(expand_fn, state, inp)
        return tree, q, state

    def draft_conditional(self, children_fn, state0, inp: DraftInput):
        """The plan's tree for a drafter that gives each node's children distribution from the node alone
        (``DraftPlan.grow_conditional``: DSpark) -> (tree, q_btv or None)."""
        tree, q, _, _ = self.plan.grow_conditional(children_fn, state0, inp)
        return tree, q

    def draft_positional(self, logp_bdv, inp: DraftInput, *, d2t_v=None, target_vocab=None):
        """The plan's tree for a block drafter, from every depth's distribution ``logp_bdv`` [B,D,V]
        drafted at once from the root (``DraftPlan.grow_positional``: DDTree's ``ddtree:`` plans
        too) -> (tree, q_btv or None). ``d2t_v`` / ``target_vocab``: drafts over a smaller draft
        vocabulary (P-EAGLE's head)."""
        tree, q, _, _ = self.plan.grow_positional(logp_bdv, None, inp, d2t_v=d2t_v, target_vocab=target_vocab)
        return tree, q


def full_proposal(tree: DraftTree, q, state) -> Proposal:
    """A proposal that asks to verify every node of ``tree`` (no contemplates)."""
    b, t = tree.tokens_bt.shape
    return Proposal(tree, q, jnp.full((b,), t, jnp.int32), None, state)


def last_accepted_hidden(v: VerifiedPass, hidden_bd: jax.Array, who: str) -> jax.Array:
    """h[p'] for every active row: the target's final-normed hidden state at the pass's last accepted
    node (``VerifyOutput.hidden_btd``, whose logits gave the bonus); inactive rows keep ``hidden_bd``."""
    if v.target.hidden_btd is None:
        raise ValueError(f"{who}.update needs VerifyOutput.hidden_btd (models.target.verify)")
    rows = jnp.arange(v.active_b.shape[0])
    h = v.target.hidden_btd[rows, v.verification.last_node_b].astype(hidden_bd.dtype)
    return jnp.where(v.active_b[:, None], h, hidden_bd)
