"""Lossless verification of a draft tree against the target's logits (docs/DESIGN.md §4).

Inputs are the target's logits at every node ([B,T,V]: the distribution of that node's NEXT
token; at the root, the distribution of its children) and a ``confu_jax.decode.tree.DraftTree``.
Each rule walks from the root, accepts a path, and draws one bonus token from the distribution
left at the last accepted node, so the emitted tokens (accepted non-root nodes, then the bonus)
are distributed exactly as autoregressive sampling from ``target_probs`` would produce them.
Temperature and top-p go through ``confu_jax.decode.sampling.target_probs``, the same function
the AR path uses; both may be traced scalars.

All rules are batched over rows, jittable, and loop only over the static node count. The loop
takes a rule as a value (``AcceptanceRule``: ``GREEDY``, ``SAMPLED_TREE``, ``SAMPLED_CHAIN``), which
a draft plan picks for a temperature (``decode.plans.DraftPlan.rule``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.decode.sampling import sample, target_probs
from confu_jax.decode.tree import DraftTree


class Verification(NamedTuple):
    """Outcome per row; D = the tree's maximum depth."""

    path_bd: jax.Array  # [B,D+1] int32 accepted node indices root-first; -1 past n_accepted
    n_accepted_b: jax.Array  # [B] int32 accepted nodes incl. the root (>= 1) = tokens emitted
    bonus_b: jax.Array  # [B] int32 token drawn at the last accepted node
    last_node_b: jax.Array  # [B] int32 index of the last accepted node (its logits gave the bonus)
    emitted_bd: jax.Array  # [B,D+1] int32 accepted non-root tokens then the bonus; -1 padded


def make_verification(tree: DraftTree, last_b: jax.Array, bonus_b: jax.Array) -> Verification:
    """Assemble the outcome from the last accepted node and the bonus token (any rule's tail)."""
    rows = jnp.arange(last_b.shape[0])
    path_bd = tree.path_btd[rows, last_b]
    n_b = tree.depth_bt[rows, last_b] + 1
    d = path_bd.shape[1]
    j = jnp.arange(d)[None, :]
    nxt = jnp.concatenate([path_bd[:, 1:], jnp.full_like(path_bd[:, :1], -1)], axis=1)
    nxt_tok = jnp.take_along_axis(tree.tokens_bt, jnp.maximum(nxt, 0), axis=1)
    emitted = jnp.where(j < n_b[:, None] - 1, nxt_tok,
                        jnp.where(j == n_b[:, None] - 1, bonus_b[:, None], -1))
    return Verification(path_bd, n_b.astype(jnp.int32), bonus_b.astype(jnp.int32),
                        last_b.astype(jnp.int32), emitted.astype(jnp.int32))


def _check_shapes(rule: str, tree: DraftTree, logits_btv: jax.Array) -> None:
    if logits_btv.ndim != 3 or logits_btv.shape[:2] != tree.tokens_bt.shape:
        raise ValueError(f"{rule}: logits_btv must be [B,T,V] with [B,T] = tree.tokens_bt.shape "
                         f"{tree.tokens_bt.shape}; got {logits_btv.shape}")


def _parent_values(tree: DraftTree, x_bt: jax.Array) -> jax.Array:
    """x at each node's parent (the root maps to itself; callers mask it)."""
    return jnp.take_along_axis(x_bt, jnp.maximum(tree.parents_bt, 0), axis=1)


def verify_greedy(tree: DraftTree, logits_btv: jax.Array) -> Verification:
    """Accept a node iff every node on its path equals the target's argmax at its parent.

    Among accepted nodes the deepest wins (lowest index on ties, which only duplicate siblings
    can produce; they emit the same tokens). The bonus is the argmax at that node, the same
    ``argmax(logits)`` that greedy AR decoding takes.
    """
    _check_shapes("verify_greedy", tree, logits_btv)
    argmax_bt = jnp.argmax(logits_btv, axis=-1).astype(jnp.int32)
    t = tree.tokens_bt.shape[1]
    node_t = jnp.arange(t)
    matches_bt = tree.tokens_bt == _parent_values(tree, argmax_bt)
    correct_bt = (node_t == 0) | (tree.valid_bt & matches_bt)
    accepted_bt = ~jnp.any(tree.ancestor_btt & ~correct_bt[:, None, :], axis=-1)
    score = jnp.where(accepted_bt, tree.depth_bt * t + (t - 1 - node_t), -1)
    last_b = jnp.argmax(score, axis=-1).astype(jnp.int32)
    bonus_b = jnp.take_along_axis(argmax_bt, last_b[:, None], axis=1)[:, 0]
    return make_verification(tree, last_b, bonus_b)


def verify_sampled_tree(tree: DraftTree, logits_btv: jax.Array, key: jax.Array, temperature,
                        top_p=1.0) -> Verification:
    """Sequential residual rule for deterministically drafted trees (one draw per sibling).

    At the current node with target distribution p, r <- p; its children are tried in draft
    order (increasing node index): child c is accepted with probability r(c)/sum(r), otherwise
    r(c) <- 0. If one is accepted the walk moves to it (r <- its p); if none is, the bonus is
    drawn from r/sum(r). Induction over the children shows the emitted token is distributed as p.

    A single scan over node indices suffices: children come after their parent, and once a child
    is accepted its later siblings no longer match the current node. Duplicate-token siblings
    are tried with r(c) = 0 and never accepted; padding (invalid) children are skipped. If r's
    mass on untried tokens is 0, the last candidate with mass is accepted with probability 1
    (u * sum(r) < r(c) with u < 1), so sum(r) = 0 at bonus time is impossible in exact arithmetic;
    should rounding produce it, the bonus falls back to p at that node.
    """
    _check_shapes("verify_sampled_tree", tree, logits_btv)
    p_btv = target_probs(logits_btv, temperature, top_p)
    b, t, v = p_btv.shape
    k_acc, k_bonus = jax.random.split(key)
    u_bt = jax.random.uniform(k_acc, (b, t), jnp.float32)
    rows = jnp.arange(b)
    # The residual r is never materialised during the walk: at the current node it is p(cur) with
    # the tokens of cur's rejected children zeroed, so the walk needs only sum(r) (a [B] carry, kept
    # up to date by subtraction) and r(c) = p(cur, c) unless an earlier sibling with the same token
    # was rejected. Each step costs O(T), not a [B, V] sum and select; r is built once for the bonus.
    psum_bt = jnp.sum(p_btv, axis=-1)

    def step(carry, j):
        cur_b, rsum_b, rejected_bt = carry
        tok_b = tree.tokens_bt[:, j]
        is_child = tree.valid_bt[:, j] & (tree.parents_bt[:, j] == cur_b)
        dup_b = jnp.any(rejected_bt & (tree.parents_bt == cur_b[:, None]) & (tree.tokens_bt == tok_b[:, None]),
                        axis=1)
        r_c = jnp.where(dup_b, 0.0, p_btv[rows, cur_b, tok_b])
        accept = is_child & (u_bt[:, j] * rsum_b < r_c)
        reject = is_child & ~accept
        rejected_bt = rejected_bt.at[:, j].set(reject)
        rsum_b = jnp.where(accept, psum_bt[:, j], jnp.where(reject, rsum_b - r_c, rsum_b))
        return (jnp.where(accept, j, cur_b), rsum_b, rejected_bt), None

    init = (jnp.zeros((b,), jnp.int32), psum_bt[:, 0], jnp.zeros((b, t), bool))
    (last_b, _, rejected_bt), _ = jax.lax.scan(step, init, jnp.arange(1, t, dtype=jnp.int32))
    p_last = p_btv[rows, last_b]
    zero_bt = rejected_bt & (tree.parents_bt == last_b[:, None])
    r_bv = p_last.at[rows[:, None], jnp.where(zero_bt, tree.tokens_bt, v)].set(0.0, mode="drop")
    r_bv = jnp.where(jnp.sum(r_bv, axis=-1, keepdims=True) > 0, r_bv, p_last)
    bonus_b = sample(k_bonus, r_bv).astype(jnp.int32)
    return make_verification(tree, last_b, bonus_b)


def verify_sampled_chain(tree: DraftTree, logits_btv: jax.Array, q_btv: jax.Array,
                         key: jax.Array, temperature, top_p=1.0) -> Verification:
    """Speculative sampling for a chain drafted by sampling (Leviathan et al.).

    ``tree`` must be a chain (node i's parent is i-1, as from ``draft_sampled_chain``) and
    ``q_btv[:, i]`` the draft distribution node i was sampled from. Node i is accepted with
    probability min(1, p(x_i)/q(x_i)), p the target distribution at node i-1; at the first
    rejection the bonus is drawn from norm(max(p - q, 0)). That residual has zero mass only
    when p <= q everywhere, i.e. p = q, where rejection has probability 0; if rounding gets
    there anyway the bonus is drawn from p. A padding (invalid) node ends the chain without a
    rejection: the bonus is then drawn from p at the last accepted node, as after a full accept.
    """
    _check_shapes("verify_sampled_chain", tree, logits_btv)
    p_btv = target_probs(logits_btv, temperature, top_p)
    b, t, _ = p_btv.shape
    if q_btv.shape != p_btv.shape:
        raise ValueError(f"verify_sampled_chain: q_btv must match the logits' shape {p_btv.shape}, "
                         f"got {q_btv.shape}")
    k_acc, k_bonus = jax.random.split(key)
    u_bt = jax.random.uniform(k_acc, (b, t), jnp.float32)
    tok_bt1 = tree.tokens_bt[:, 1:, None]
    p_at = jnp.take_along_axis(p_btv[:, :-1], tok_bt1, axis=-1)[..., 0]  # [B,T-1] p_{i-1}(x_i)
    q_at = jnp.take_along_axis(q_btv[:, 1:], tok_bt1, axis=-1)[..., 0]  # q_i(x_i)
    ok = tree.valid_bt[:, 1:] & (u_bt[:, 1:] * q_at < p_at)
    n_ok = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # accepted drafted nodes
    last_b = n_ok.astype(jnp.int32)
    rows = jnp.arange(b)
    p_last = p_btv[rows, last_b]
    first_fail = jnp.minimum(last_b + 1, t - 1)
    rejected = (last_b < t - 1) & tree.valid_bt[rows, first_fail]
    resid = jnp.maximum(p_last - q_btv[rows, first_fail], 0.0)
    use_resid = rejected & (jnp.sum(resid, axis=-1) > 0)
    bonus_b = sample(k_bonus, jnp.where(use_resid[:, None], resid, p_last)).astype(jnp.int32)
    return make_verification(tree, last_b, bonus_b)


@dataclasses.dataclass(frozen=True)
class AcceptanceRule(abc.ABC):
    """A lossless acceptance rule as a value (hashable: a static argument of the jitted loop).
    ``name`` is its text form in logs and benchmark tables."""

    name: ClassVar[str]

    @abc.abstractmethod
    def accept(self, tree: DraftTree, logits_btv: jax.Array, q_btv: Optional[jax.Array], key: jax.Array,
               temperature, top_p) -> Verification:
        """The accepted path and bonus of every row (``q_btv``: the draft distributions, where the
        rule needs them)."""

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class GreedyRule(AcceptanceRule):
    """Temperature 0: follow the target's argmax (``verify_greedy``)."""

    name: ClassVar[str] = "greedy"

    def accept(self, tree, logits_btv, q_btv, key, temperature, top_p) -> Verification:
        return verify_greedy(tree, logits_btv)


@dataclasses.dataclass(frozen=True)
class SampledTreeRule(AcceptanceRule):
    """Temperature > 0, deterministically drafted trees: sequential residuals (``verify_sampled_tree``)."""

    name: ClassVar[str] = "sampled_tree"

    def accept(self, tree, logits_btv, q_btv, key, temperature, top_p) -> Verification:
        return verify_sampled_tree(tree, logits_btv, key, temperature, top_p)


@dataclasses.dataclass(frozen=True)
class SampledChainRule(AcceptanceRule):
    """Temperature > 0, chains sampled from the draft: Leviathan's rule (``verify_sampled_chain``)."""

    name: ClassVar[str] = "sampled_chain"

    def accept(self, tree, logits_btv, q_btv, key, temperature, top_p) -> Verification:
        if q_btv is None:
            raise ValueError("the sampled-chain rule needs the draft distributions q_btv; the proposal has none")
        return verify_sampled_chain(tree, logits_btv, q_btv, key, temperature, top_p)


GREEDY = GreedyRule()
SAMPLED_TREE = SampledTreeRule()
SAMPLED_CHAIN = SampledChainRule()
