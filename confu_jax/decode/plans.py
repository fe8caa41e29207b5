"""Draft plans: the shape of the tree a drafter proposes each iteration, as types.

A plan is a small frozen value — ``Chain``, ``SampledChain``, ``StaticTree``, ``DynamicTree`` or, for
block drafters, ``BlockTree`` and ``FanoutTree`` —
and a static argument of the speculative program (changing it recompiles). Each type knows its
depth, node count, draft scratch size and text form, how its tree grows from a drafter's
``expand_fn`` (``grow``), and the lossless acceptance rule it needs at a temperature (``rule``), so
nothing in ``decode/`` switches on a plan's name. ``parse_plan`` reads the CLI/config form
(``chain:4``, ``dynamic:6,8,30``, ``tree:3,2``, ``ddtree:30,8``); ``text`` writes it back.

**Block drafters** (DFlash's block, Medusa's heads) draft every depth's distribution at once, from
the root alone: ``grow_positional(logp_bdv, ...)`` grows any plan from those per-depth
distributions, and ``ddtree:N[,D]`` (``BlockTree``, DDTree's best-first tree) and ``accum_logp:N,W[,D]``
(``FanoutTree``, JetSpec's expand-the-best-node tree) are grown only so.

``contemplates`` (ConFu only; 0 = after every node) makes contemplates sparse: only M of the T nodes
get a contemplate token in the verification pass (T + M queries instead of 2T) — the M nodes the
draft scores highest (``DraftPlan.nodes_ranked``: chains and static trees list their nodes in that
order already, so the first M; a dynamic tree by cumulative draft log-probability), the root always
among them. The next iteration's future vector comes from the deepest contemplated node on the
accepted path (docs/DESIGN.md §4). Other families refuse it.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode import verify as verify_lib

PLAN_FORMS = ("chain:K, sampled_chain:K, dynamic:DEPTH,TOPK,NODES or tree:k1,...,kD (the Cartesian tree of "
              "per-depth top-k), optionally +cM for ConFu's sparse contemplates (e.g. chain:4, dynamic:6,8,30, "
              "dynamic:6,10,60+c15, tree:3,2)")


@dataclasses.dataclass(frozen=True)
class DraftPlan(abc.ABC):
    """Base of the plan types (hashable: a static jit argument)."""

    contemplates: int = dataclasses.field(default=0, kw_only=True)

    #: the tree lists its nodes best-first (root, then the draft's preferred children first), so
    #: sparse contemplates take the first M; False: rank them by the tree's node scores
    nodes_ranked: ClassVar[bool] = True
    #: one node per depth (a drafter that keeps no sibling state may draft it)
    linear: ClassVar[bool] = False

    def __post_init__(self):
        if not 0 <= self.contemplates <= self.n_nodes_total:
            raise ValueError(f"contemplates must be in [1, T={self.n_nodes_total}] (or 0: after every node); "
                             f"got {self.contemplates} for {self.body_text}")

    @property
    @abc.abstractmethod
    def max_depth(self) -> int:
        """D: the deepest node (the root is depth 0)."""

    @property
    def n_nodes_total(self) -> int:
        """T: tree nodes per verification, root included."""
        return self.structure().n_nodes

    @property
    def n_contemplates(self) -> int:
        """M: contemplate tokens per verification (ConFu); T unless the plan makes them sparse."""
        return self.contemplates or self.n_nodes_total

    @property
    def n_scratch(self) -> int:
        """Draft scratch slots one iteration uses (the K/V of the expanded tree nodes)."""
        return tree_lib.scratch_slots(self.structure())

    def structure(self) -> tree_lib.StaticStructure:
        """The fixed tree shape (every plan but a dynamic tree has one)."""
        raise ValueError(f"a {type(self).__name__} plan has no fixed structure")

    @property
    @abc.abstractmethod
    def body_text(self) -> str:
        """The text form without the ``+cM`` suffix."""

    @property
    def text(self) -> str:
        """The form ``parse_plan`` reads."""
        return self.body_text + (f"+c{self.contemplates}" if self.contemplates else "")

    def grow(self, expand_fn, state, inp, *, d2t_v=None, target_vocab=None):
        """This plan's tree grown by ``expand_fn`` (``decode.tree``'s contract) from ``inp.root_b``
        -> (tree, q_btv or None, each node's cumulative draft log-probability [B,T] or None, the
        state after drafting). ``inp``: a ``decode.drafter.DraftInput``; ``d2t_v`` /
        ``target_vocab``: drafts over a smaller draft vocabulary (the EAGLE-3 / ConFu head)."""
        tree, score, state = tree_lib.draft_static_tree(expand_fn, state, inp.root_b, self.structure(), d2t_v=d2t_v,
                                                        return_scores=True)
        return tree, None, score, state

    def grow_positional(self, logp_bdv, state, inp, *, d2t_v=None, target_vocab=None):
        """``grow`` for a block drafter: ``logp_bdv`` [B,D',V] (D' >= D) holds the draft's distribution of
        every depth d+1, the same under every parent (it is drafted from the root alone)."""
        b, v = logp_bdv.shape[0], logp_bdv.shape[-1]

        def expand_fn(s, fr: tree_lib.Frontier):
            lp = logp_bdv[:, fr.depth][:, None, :]
            return jnp.broadcast_to(lp, (b, fr.tokens_bk.shape[1], v)), s

        return self.grow(expand_fn, state, inp, d2t_v=d2t_v, target_vocab=target_vocab)

    def grow_conditional(self, children_fn, state0, inp, *, d2t_v=None, target_vocab=None):
        """``grow`` for a drafter that gives each node's children distribution from the node alone:
        ``children_fn(tokens_bk, depth_bk, state_bk) -> (logp_bkv, state_bk)`` over [B,K] nodes (their
        target-vocabulary tokens, their depths, the per-node state their parents left: ``state0`` [B,1,...]
        or None for the root) — DSpark's block slot plus its Markov bias. Through a per-depth ``expand_fn``;
        ``ddtree:`` plans pop node by node instead (``BlockTree``)."""

        def expand_fn(s, fr: tree_lib.Frontier):
            parent = None if s is None else jax.tree_util.tree_map(
                lambda x: jnp.take_along_axis(x, fr.parent_slot_bk.reshape(fr.parent_slot_bk.shape + (1,) * (x.ndim - 2)),
                                              axis=1), s)
            return children_fn(fr.tokens_bk, jnp.full(fr.tokens_bk.shape, fr.depth, jnp.int32), parent)

        return self.grow(expand_fn, state0, inp, d2t_v=d2t_v, target_vocab=target_vocab)

    def rule(self, greedy: bool) -> verify_lib.AcceptanceRule:
        """The lossless acceptance rule for this plan's trees: greedy at temperature 0, else
        sequential residuals (deterministic drafts)."""
        return verify_lib.GREEDY if greedy else verify_lib.SAMPLED_TREE


@dataclasses.dataclass(frozen=True)
class _KChain(DraftPlan):
    """K nodes in a line below the root (shared by the two chain plans)."""

    k: int
    linear: ClassVar[bool] = True

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"{self.body_text} needs k >= 1, got {self.k}")
        super().__post_init__()

    @property
    def max_depth(self) -> int:
        return self.k

    def structure(self) -> tree_lib.StaticStructure:
        return tree_lib.chain_structure(self.k)


@dataclasses.dataclass(frozen=True)
class Chain(_KChain):
    """``chain:K``: the draft's top-1, K deep."""

    @property
    def body_text(self) -> str:
        return f"chain:{self.k}"


@dataclasses.dataclass(frozen=True)
class SampledChain(_KChain):
    """``sampled_chain:K``: K tokens sampled from the draft at the target's temperature / top-p,
    verified by Leviathan's rule at temperature > 0 (greedy at 0)."""

    @property
    def body_text(self) -> str:
        return f"sampled_chain:{self.k}"

    def grow(self, expand_fn, state, inp, *, d2t_v=None, target_vocab=None):
        tree, q, state = tree_lib.draft_sampled_chain(expand_fn, state, inp.root_b, self.k, inp.key, inp.temperature,
                                                      inp.top_p, d2t_v=d2t_v, target_vocab=target_vocab)
        return tree, q, None, state

    def rule(self, greedy: bool) -> verify_lib.AcceptanceRule:
        return verify_lib.GREEDY if greedy else verify_lib.SAMPLED_CHAIN


@dataclasses.dataclass(frozen=True)
class StaticTree(DraftPlan):
    """A fixed tree of paths ((r_1..r_d): the r_i-th best draft token at depth i), as EAGLE's and
    Medusa's "choices"; ``cartesian(ks)`` builds Medusa-1's tree (text ``tree:k1,...,kD``)."""

    paths: tuple

    def __post_init__(self):
        if not self.paths:
            raise ValueError("a static tree needs a non-empty list of paths")
        object.__setattr__(self, "paths", tuple(tuple(int(r) for r in p) for p in self.paths))
        super().__post_init__()

    @classmethod
    def cartesian(cls, top_ks, **kw) -> "StaticTree":
        """Medusa-1's Cartesian tree: every path (r_1..r_d), d ≤ D, r_i < top_ks[i-1]."""
        return cls(cartesian_paths(top_ks), **kw)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def structure(self) -> tree_lib.StaticStructure:
        return tree_lib.static_structure(self.paths)

    @property
    def body_text(self) -> str:
        ks = tuple(1 + max(q[i] for q in self.paths if len(q) > i) for i in range(self.max_depth))
        if sorted(cartesian_paths(ks)) == sorted(self.paths):
            return "tree:" + ",".join(map(str, ks))
        return f"static:{list(self.paths)}"


@dataclasses.dataclass(frozen=True)
class DynamicTree(DraftPlan):
    """``dynamic:DEPTH,TOPK,NODES`` (EAGLE-2): expand the top_k best frontier nodes per depth, keep
    the n_nodes best by cumulative draft log-probability (``n_nodes`` includes the root; the text's
    NODES does not, as EAGLE-2's total_tokens)."""

    depth: int
    top_k: int
    n_nodes: int
    nodes_ranked: ClassVar[bool] = False

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.n_nodes < 2:
            raise ValueError(f"a dynamic tree needs depth>=1, top_k>=1, n_nodes>=2; got {self}")
        super().__post_init__()

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def n_nodes_total(self) -> int:
        return self.n_nodes

    @property
    def n_scratch(self) -> int:
        return tree_lib.dynamic_scratch_size(self.depth, self.top_k)

    @property
    def body_text(self) -> str:
        return f"dynamic:{self.depth},{self.top_k},{self.n_nodes - 1}"

    def grow(self, expand_fn, state, inp, *, d2t_v=None, target_vocab=None):
        tree, score, state = tree_lib.draft_dynamic_tree(expand_fn, state, inp.root_b, depth=self.depth,
                                                         top_k=self.top_k, n_nodes=self.n_nodes, d2t_v=d2t_v)
        return tree, None, score, state


@dataclasses.dataclass(frozen=True)
class BlockTree(DraftPlan):
    """``ddtree:N[,D]`` (DDTree, arXiv 2604.12989): the N best nodes, by the sum of their path's draft
    log-probabilities, of the tree of every position's top-k (``decode.tree.draft_block_tree``), at
    most D deep (D defaults to N: any shape the budget reaches). Grown by a block drafter whose every
    position's distribution comes from the root alone (``grow_positional``: DFlash, Medusa, P-EAGLE) or
    from the node it follows (``grow_conditional``: DSpark's Markov bias; ``draft_best_first_tree``),
    not through a per-depth ``expand_fn``."""

    n_nodes: int  # the root included (the text's N does not count it, as dynamic's NODES)
    depth: int

    def __post_init__(self):
        if self.n_nodes < 2 or self.depth < 1:
            raise ValueError(f"a ddtree plan needs N >= 1 drafted nodes and depth D >= 1; got N = "
                             f"{self.n_nodes - 1}, D = {self.depth}")
        if self.depth > self.n_nodes - 1:
            raise ValueError(f"ddtree:{self.n_nodes - 1},{self.depth}: a depth past N = {self.n_nodes - 1} is never "
                             "reached (N nodes are at most N deep)")
        super().__post_init__()

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def n_nodes_total(self) -> int:
        return self.n_nodes

    @property
    def n_scratch(self) -> int:
        return 1  # block drafters keep no per-node draft state

    @property
    def body_text(self) -> str:
        n = self.n_nodes - 1
        return f"ddtree:{n}" if self.depth == n else f"ddtree:{n},{self.depth}"

    def grow(self, expand_fn, state, inp, *, d2t_v=None, target_vocab=None):
        raise ValueError(f"plan {self.text!r} is a tree over a block draft: it needs a drafter whose every position's "
                         "distribution is drafted at once from the root (DFlash, Medusa), not one that conditions "
                         "on the tokens it drafted")

    def grow_positional(self, logp_bdv, state, inp, *, d2t_v=None, target_vocab=None):
        tree, score = tree_lib.draft_block_tree(logp_bdv[:, :self.depth], inp.root_b, n_nodes=self.n_nodes,
                                                d2t_v=d2t_v)
        return tree, None, score, state

    def grow_conditional(self, children_fn, state0, inp, *, d2t_v=None, target_vocab=None):
        def children(tokens_b, depth_b, state):  # one node a row: the [B,1] form of children_fn
            logp, new = children_fn(tokens_b[:, None], depth_b[:, None], state)
            return logp[:, 0], new

        tree, score = tree_lib.draft_best_first_tree(children, inp.root_b, n_nodes=self.n_nodes, depth=self.depth,
                                                     d2t_v=d2t_v, state0=state0)
        return tree, None, score, state0


@dataclasses.dataclass(frozen=True)
class FanoutTree(BlockTree):
    """``accum_logp:N,W[,D]`` (JetSpec's default tree, ``decode.tree.draft_fanout_tree``): from the root,
    repeatedly expand the unexpanded node of best path log-probability with **all** its W children (the
    next block position's top-W tokens), until the tree holds N drafted nodes (the reference's ``budget``
    counts the root too: N + 1), at most D deep (D defaults to N). A block drafter's tree (``grow_positional``: every position's distribution from the root alone),
    verified like ``ddtree:`` (its tokens are a deterministic function of the block)."""

    fanout: int = 1

    def __post_init__(self):
        if self.fanout < 1:
            raise ValueError(f"an accum_logp plan needs fanout W >= 1; got {self.fanout}")
        super().__post_init__()

    @property
    def body_text(self) -> str:
        n = self.n_nodes - 1
        return f"accum_logp:{n},{self.fanout}" + ("" if self.depth == n else f",{self.depth}")

    def grow_positional(self, logp_bdv, state, inp, *, d2t_v=None, target_vocab=None):
        tree, score = tree_lib.draft_fanout_tree(logp_bdv[:, :self.depth], inp.root_b, n_nodes=self.n_nodes,
                                                 fanout=self.fanout, d2t_v=d2t_v)
        return tree, None, score, state

    def grow_conditional(self, children_fn, state0, inp, *, d2t_v=None, target_vocab=None):
        raise ValueError(f"plan {self.text!r} (JetSpec's accum_logp) offers every depth's same top-W to every parent: "
                         "it needs a drafter whose positions are drafted from the root alone (DFlash, JetSpec, Medusa); "
                         "for one that conditions on the parent use ddtree:N[,D]")


def cartesian_paths(top_ks) -> tuple:
    """Medusa-1's Cartesian tree: every path (r_1..r_d), d ≤ D, r_i < top_ks[i-1]."""
    paths = []
    for d in range(1, len(top_ks) + 1):
        paths.extend(itertools.product(*[range(k) for k in top_ks[:d]]))
    return tuple(tuple(p) for p in paths)


def parse_plan(text: str, *, what: str = "", forms: str = PLAN_FORMS, block: bool = False) -> DraftPlan:
    """``chain:K`` | ``sampled_chain:K`` | ``dynamic:DEPTH,TOPK,NODES`` (NODES excludes the root,
    as EAGLE-2's total_tokens) | ``tree:k1,...,kD``, each optionally followed by ``+cM`` (M sparse
    contemplates) -> a plan; with ``block`` (a block drafter's reader) also ``ddtree:N[,D]`` and
    ``accum_logp:N,W[,D]``. ``what``
    (a family without contemplates, e.g. "Medusa") refuses ``+cM`` naming it; ``forms`` is what
    errors list as accepted."""
    body, plus, con = text.partition("+")
    kind, _, arg = body.partition(":")
    label = f"bad {what + ' ' if what else ''}draft plan {text!r}"
    try:
        m = 0
        if plus:
            if what:
                raise ValueError(f"{what} has no contemplates (drop +cM)")
            if not con.startswith("c"):
                raise ValueError(f"the suffix {'+' + con!r} is not +cM")
            m = int(con[1:])
            if m < 1:
                raise ValueError(f"+cM needs M >= 1, got {m}")
        if kind == "chain":
            return Chain(int(arg), contemplates=m)
        if kind == "sampled_chain":
            return SampledChain(int(arg), contemplates=m)
        if kind == "dynamic":
            d, k, t = (int(x) for x in arg.split(","))
            return DynamicTree(d, k, t + 1, contemplates=m)
        if kind == "tree":
            ks = tuple(int(x) for x in arg.split(","))
            if not ks or min(ks) < 1:
                raise ValueError("tree:k1,...,kD needs every k_i >= 1")
            return StaticTree.cartesian(ks, contemplates=m)
        if kind == "ddtree" and block:
            n, *d = (int(x) for x in arg.split(","))
            if len(d) > 1:
                raise ValueError("ddtree takes N or N,D")
            return BlockTree(n + 1, d[0] if d else n, contemplates=m)
        if kind == "accum_logp" and block:
            n, w, *d = (int(x) for x in arg.split(","))
            if len(d) > 1:
                raise ValueError("accum_logp takes N,W or N,W,D")
            return FanoutTree(n + 1, d[0] if d else n, contemplates=m, fanout=w)
    except ValueError as e:
        raise ValueError(f"{label}: {e}; expected {forms}") from None
    raise ValueError(f"{label}: expected {forms}")
