"""Draft trees with static shapes: the structure every drafting strategy hands to verification.

A tree has T nodes per row in a fixed-size array. Node 0 is the ROOT: the bonus token emitted by
the previous verification (depth 0, always accepted; the target's logits at the root give the
distribution of its children). Nodes are topologically ordered (parent index < child index) and
siblings appear in draft order, which is the order the sequential sampling rule visits them
(``confu_jax.decode.verify``). Rows carry their own structure (dynamic trees differ per row);
nodes that are not part of the tree (padding) have ``valid=False`` and are never accepted.

Everything derived from the parent pointers (depths, the ancestor-or-self mask that is the
verification attention mask, and the root-to-node path table used to commit an accepted path) is
built inside jit by :func:`build_tree` with a static loop over the maximum depth.

Drafting talks to the draft model through one callable, ``expand_fn(state, frontier) ->
(logp_bkv, state)``; see :class:`Frontier` for the contract. Three drafters share it:

- :func:`draft_static_tree` fills a fixed shape (:func:`chain_structure`, :func:`static_structure`
  from EAGLE/Medusa-style "choices" paths) with the draft's top-k tokens at each parent;
- :func:`draft_sampled_chain` samples a chain from the draft and returns the draft distributions
  q the tokens were drawn from (needed by ``verify_sampled_chain``);
- :func:`draft_dynamic_tree` is EAGLE-2's dynamic tree: expand depth by depth keeping the top_k
  frontier nodes by cumulative draft log-probability, then keep the global top T-1 nodes.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.decode.sampling import sample, target_probs
from confu_jax.models import top_k as top_k_lib


class DraftTree(NamedTuple):
    """A batch of draft trees. T nodes per row, maximum depth D = ``path_btd.shape[-1] - 1``."""

    tokens_bt: jax.Array  # [B,T] int32 target-vocabulary token of each node (node 0 = root)
    parents_bt: jax.Array  # [B,T] int32 parent node index, -1 for the root and for padding
    depth_bt: jax.Array  # [B,T] int32 depth = RoPE offset: node at depth k sits at position p+1+k
    valid_bt: jax.Array  # [B,T] bool; False for padding and for descendants of padding
    ancestor_btt: jax.Array  # [B,T,T] bool: [b,i,j] = node j is an ancestor-or-self of node i
    path_btd: jax.Array  # [B,T,D+1] int32 node indices root->node; -1 past the node's depth

    @property
    def max_depth(self) -> int:
        return self.path_btd.shape[-1] - 1

    def positions_bt(self, anchor_b: jax.Array) -> jax.Array:
        """RoPE positions of the nodes when the root (bonus token) sits at ``anchor_b + 1``."""
        return anchor_b[:, None].astype(jnp.int32) + 1 + self.depth_bt


def build_tree(tokens_bt: jax.Array, parents_bt: jax.Array, max_depth: int,
               valid_bt: Optional[jax.Array] = None) -> DraftTree:
    """Derive depths, ancestor mask and path table from parent pointers (jittable).

    Walks up the parent pointers ``max_depth`` static steps. The structure is sanitised rather than
    trusted, because a malformed node that verification accepted would corrupt the KV cache:
    node 0 is forced to be the valid root, and a node is invalid if it is marked invalid, has a
    parent that is not an earlier node, lies deeper than ``max_depth``, or has an invalid
    ancestor. Invalid nodes still get a well-formed ancestor mask (at least themselves), so
    their attention rows never see an empty key set.
    """
    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    parents_bt = jnp.asarray(parents_bt, jnp.int32)
    if tokens_bt.ndim != 2 or parents_bt.shape != tokens_bt.shape:
        raise ValueError(f"build_tree: tokens_bt and parents_bt must both be [B,T]; got "
                         f"{tokens_bt.shape} and {parents_bt.shape}")
    b, t = tokens_bt.shape
    node_t = jnp.arange(t, dtype=jnp.int32)
    if valid_bt is None:
        valid_bt = jnp.ones((b, t), bool)
    valid_bt = jnp.asarray(valid_bt, bool)
    # parents must point strictly backwards; the root has none
    parents_bt = jnp.where(node_t == 0, -1, parents_bt)
    well_formed = (node_t == 0) | ((parents_bt >= 0) & (parents_bt < node_t))
    valid_bt = (valid_bt | (node_t == 0)) & well_formed
    parents_bt = jnp.where(well_formed, parents_bt, -1)

    def parent_of(idx_bt):  # -1 stays -1
        p = jnp.take_along_axis(parents_bt, jnp.maximum(idx_bt, 0), axis=1)
        return jnp.where(idx_bt >= 0, p, -1)

    # anc_k[b,i] = k-th ancestor of node i (k=0: itself), -1 once past the root
    anc_k = [jnp.broadcast_to(node_t, (b, t))]
    for _ in range(max_depth):
        anc_k.append(parent_of(anc_k[-1]))
    too_deep = parent_of(anc_k[-1]) >= 0  # a (max_depth+1)-th ancestor exists
    anc_kbt = jnp.stack(anc_k)  # [D+1,B,T]
    has_anc = anc_kbt >= 0
    depth_bt = jnp.sum(has_anc[1:], axis=0).astype(jnp.int32)
    # the root (anc at k = depth) of a well-formed chain must be node 0
    reaches_root = jnp.take_along_axis(anc_kbt, depth_bt[None], axis=0)[0] == 0
    anc_valid = jnp.take_along_axis(valid_bt[None].repeat(max_depth + 1, 0),
                                    jnp.maximum(anc_kbt, 0), axis=2)
    valid_bt = (jnp.all(anc_valid | ~has_anc, axis=0) & ~too_deep & reaches_root
                & valid_bt)
    ancestor_btt = jnp.any(
        has_anc[..., None] & (anc_kbt[..., None] == node_t[None, None, None, :]), axis=0)
    # path[b,i,j] = ancestor at k = depth - j, for j <= depth
    j_d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    k_btd = depth_bt[..., None] - j_d
    path_btd = jnp.take_along_axis(jnp.moveaxis(anc_kbt, 0, -1), jnp.clip(k_btd, 0, max_depth),
                                   axis=-1)
    path_btd = jnp.where(k_btd >= 0, path_btd, -1)
    return DraftTree(tokens_bt, parents_bt, depth_bt, valid_bt, ancestor_btt, path_btd)


# --------------------------------------------------------------------------------------------
# Drafting contract


class Frontier(NamedTuple):
    """What ``expand_fn`` is told about the nodes it must expand at one depth.

    The draft runs once per depth on a frontier of K nodes (K=1 for the root call). Each call
    writes its K nodes to scratch slots ``[slot_offset, slot_offset+K)`` of a per-tree scratch
    buffer of ``n_scratch`` slots (e.g. the draft's tree KV entries); ``ancestor_bkn`` says which
    scratch slots each node may attend to (its ancestors and itself), ``parent_slot_bk`` indexes
    the parent within the previous call's frontier (gather per-node state such as the draft's
    hidden state with it; all zeros at depth 0). ``depth`` is the nodes' RoPE offset (position
    p+1+depth); ``slot_offset``, ``depth`` and ``n_scratch`` are Python ints (static).
    """

    tokens_bk: jax.Array  # [B,K] int32 target-vocabulary tokens
    parent_slot_bk: jax.Array  # [B,K] int32 index into the previous frontier
    ancestor_bkn: jax.Array  # [B,K,n_scratch] bool, ancestor-or-self over scratch slots
    depth: int
    slot_offset: int
    n_scratch: int


ExpandFn = Callable[[Any, Frontier], Tuple[jax.Array, Any]]
"""``expand_fn(state, frontier) -> (logp_bkv, state)``: draft log-probabilities over the draft
vocabulary (size V_d) of the next token after each frontier node, plus whatever state the draft
threads between depths (its scratch KV buffer, per-node hidden states, the ConFu future entry).
It is called at trace time once per depth, with static shapes, so it may close over parameters.
"""


def _map_tokens(idx, d2t_v):
    """Draft-vocabulary ids -> target ids (identity when the draft shares the target vocab)."""
    return idx.astype(jnp.int32) if d2t_v is None else jnp.asarray(d2t_v, jnp.int32)[idx]


# --------------------------------------------------------------------------------------------
# Static trees


class StaticStructure(NamedTuple):
    """Host-side (numpy) shape of a static tree and the per-depth expansion plan."""

    parents_t: np.ndarray  # [T] parent index, -1 for the root; nodes in BFS order
    depth_t: np.ndarray  # [T]
    rank_t: np.ndarray  # [T] child rank: node is its parent's rank-th most probable draft token
    paths: Tuple[Tuple[int, ...], ...]  # node i's choice path (root = ())

    @property
    def n_nodes(self) -> int:
        return len(self.parents_t)

    @property
    def max_depth(self) -> int:
        return int(self.depth_t.max())


def static_tree(tokens_bt: jax.Array, structure: StaticStructure) -> DraftTree:
    """The DraftTree of a static shape filled with ``tokens_bt``: depths, validity, ancestor mask
    and paths depend on the shape only, so they are computed once at trace time (compile-time
    constants broadcast over rows) instead of rebuilt by :func:`build_tree` in every iteration."""
    b, t = tokens_bt.shape
    if t != structure.n_nodes:
        raise ValueError(f"static_tree: tokens_bt has {t} nodes; the structure has {structure.n_nodes}")
    parents = np.asarray(structure.parents_t, np.int32)
    depth = np.asarray(structure.depth_t, np.int32)
    ancestor = np.zeros((t, t), bool)
    path = np.full((t, structure.max_depth + 1), -1, np.int32)
    for i in range(t):
        node = i
        while node >= 0:  # parents point backwards (static_structure checks it)
            ancestor[i, node] = True
            path[i, depth[node]] = node
            node = parents[node]
    rows = lambda x: jnp.broadcast_to(x, (b,) + x.shape)  # noqa: E731
    return DraftTree(jnp.asarray(tokens_bt, jnp.int32), rows(parents), rows(depth), rows(np.ones(t, bool)),
                     rows(ancestor), rows(path))


def static_structure(paths: Sequence[Sequence[int]]) -> StaticStructure:
    """Tree shape from EAGLE/Medusa "choices": each path lists child ranks from the root.

    ``[(0,), (1,), (0, 0), (0, 1)]`` is the root's top-2 children and the top-2 children of its
    top child. Every prefix of a path must itself be listed. Nodes are ordered by depth, then
    lexicographically, so parents precede children and siblings come in rank (draft) order.
    """
    norm = [tuple(int(c) for c in p) for p in paths]
    seen = set()
    for p in norm:
        if not p:
            raise ValueError("static_structure: the empty path is the root; do not list it")
        if min(p) < 0:
            raise ValueError(f"static_structure: child ranks must be >= 0, got path {p}")
        if p in seen:
            raise ValueError(f"static_structure: path {p} is listed twice")
        seen.add(p)
    for p in norm:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"static_structure: path {p} needs its parent {p[:-1]} listed too")
    ordered = [()] + sorted(norm, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = np.array([-1] + [index[p[:-1]] for p in ordered[1:]], np.int32)
    depth = np.array([len(p) for p in ordered], np.int32)
    rank = np.array([0] + [p[-1] for p in ordered[1:]], np.int32)
    return StaticStructure(parents, depth, rank, tuple(ordered))


def chain_structure(k: int) -> StaticStructure:
    """A chain of ``k`` drafted tokens below the root (T = k+1): each node the draft's top-1."""
    if k < 1:
        raise ValueError(f"chain_structure: need k >= 1 drafted tokens, got {k}")
    return static_structure([(0,) * i for i in range(1, k + 1)])


def _expansion_plan(structure: StaticStructure):
    """Per depth: which nodes are expanded (those with children), and their scratch slots."""
    parents, depth = structure.parents_t, structure.depth_t
    has_child = np.zeros(len(parents), bool)
    has_child[parents[parents >= 0]] = True
    frontiers, slot_of, offset = [], {}, 0
    for d in range(structure.max_depth):
        nodes = [i for i in range(len(parents)) if depth[i] == d and has_child[i]]
        for j, i in enumerate(nodes):
            slot_of[i] = offset + j
        frontiers.append((nodes, offset))
        offset += len(nodes)
    return frontiers, slot_of, offset


def scratch_slots(structure: StaticStructure) -> int:
    """Scratch slots the drafter needs for a static tree: one per expanded (non-leaf) node."""
    return _expansion_plan(structure)[2]


def _static_frontiers(structure: StaticStructure, batch: int):
    """Host-side constants for each expansion call: nodes, parent slots, ancestor masks."""
    frontiers, slot_of, n_scratch = _expansion_plan(structure)
    parents = structure.parents_t
    out = []
    prev_nodes: list = []
    for d, (nodes, offset) in enumerate(frontiers):
        pslot = np.array([prev_nodes.index(parents[i]) if d > 0 else 0 for i in nodes], np.int32)
        anc = np.zeros((len(nodes), n_scratch), bool)
        for j, i in enumerate(nodes):
            a = i
            while a >= 0:
                anc[j, slot_of[a]] = True
                a = parents[a]
        out.append((np.array(nodes, np.int32), offset,
                    np.broadcast_to(pslot, (batch, len(nodes))),
                    np.broadcast_to(anc, (batch,) + anc.shape)))
        prev_nodes = nodes
    return out, n_scratch


def draft_static_tree(expand_fn: ExpandFn, state: Any, root_token_b: jax.Array,
                      structure: StaticStructure,
                      d2t_v: Optional[jax.Array] = None, return_scores: bool = False):
    """Fill a static tree with the draft's top-k tokens, one ``expand_fn`` call per depth.

    A node of rank r is its parent's r-th most probable draft token. At each depth only the nodes
    that have children are expanded (the frontier), so a chain costs one single-node call per
    drafted token. Returns the tree and the state after the last expansion; with
    ``return_scores`` also [B,T] each node's cumulative draft log-probability (root 0), as
    ``(tree, score_bt, state)``.
    """
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    b = root_token_b.shape[0]
    t = structure.n_nodes
    plans, n_scratch = _static_frontiers(structure, b)
    tokens_bt = jnp.zeros((b, t), jnp.int32).at[:, 0].set(root_token_b)
    score_bt = jnp.zeros((b, t), jnp.float32)
    parents, rank = structure.parents_t, structure.rank_t
    for d, (nodes, offset, pslot, anc) in enumerate(plans):
        frontier = Frontier(tokens_bt[:, nodes], jnp.asarray(pslot), jnp.asarray(anc), d, offset,
                            n_scratch)
        logp_bkv, state = expand_fn(state, frontier)
        _check_logp(logp_bkv, b, len(nodes), d)
        children = np.nonzero(structure.depth_t == d + 1)[0]
        k_max = int(rank[children].max()) + 1
        if k_max > logp_bkv.shape[-1]:
            raise ValueError(f"draft_static_tree: a path asks for child rank {k_max - 1} but the "
                             f"draft vocabulary has only {logp_bkv.shape[-1]} tokens")
        top_lp_bkr, top_bkr = top_k_lib.top_k(logp_bkv, k_max)
        top_bkr = _map_tokens(top_bkr, d2t_v)
        pos = np.array([list(nodes).index(parents[c]) for c in children])
        tokens_bt = tokens_bt.at[:, children].set(top_bkr[:, pos, rank[children]])
        score_bt = score_bt.at[:, children].set(score_bt[:, parents[children]]
                                                + top_lp_bkr[:, pos, rank[children]].astype(jnp.float32))
    if return_scores:
        return static_tree(tokens_bt, structure), score_bt, state
    return static_tree(tokens_bt, structure), state


def _check_logp(logp_bkv, b, k, depth):
    if logp_bkv.ndim != 3 or logp_bkv.shape[:2] != (b, k):
        raise ValueError(f"expand_fn at depth {depth} must return logp [B={b},K={k},V_draft]; "
                         f"got shape {logp_bkv.shape}")


def draft_sampled_chain(expand_fn: ExpandFn, state: Any, root_token_b: jax.Array, k: int,
                        key: jax.Array, temperature, top_p=1.0,
                        d2t_v: Optional[jax.Array] = None,
                        target_vocab: Optional[int] = None
                        ) -> Tuple[DraftTree, jax.Array, Any]:
    """Sample a chain of ``k`` tokens from the draft, q = ``target_probs(draft logp, T, top_p)``.

    Returns ``(tree, q_btv, state)``: ``q_btv[:, i]`` is the target-vocabulary distribution node i
    was drawn from (row 0, the root, is zeros). The draft goes through the same temperature/top-p
    processing as the target: any q is lossless, but a q close to p accepts more.
    """
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    b = root_token_b.shape[0]
    structure = chain_structure(k)
    plans, n_scratch = _static_frontiers(structure, b)
    tokens = [root_token_b]
    qs = []
    keys = jax.random.split(key, k)
    for d, (nodes, offset, pslot, anc) in enumerate(plans):
        frontier = Frontier(tokens[-1][:, None], jnp.asarray(pslot), jnp.asarray(anc), d, offset,
                            n_scratch)
        logp_bkv, state = expand_fn(state, frontier)
        _check_logp(logp_bkv, b, 1, d)
        q_bv = target_probs(logp_bkv[:, 0], temperature, top_p)
        tok_b = sample(keys[d], q_bv)
        if d2t_v is not None:
            if target_vocab is None:
                raise ValueError("draft_sampled_chain: target_vocab is required with d2t_v")
            q_bv = jnp.zeros((b, target_vocab), q_bv.dtype).at[:, jnp.asarray(d2t_v)].add(q_bv)
        tokens.append(_map_tokens(tok_b, d2t_v))
        qs.append(q_bv)
    q_btv = jnp.stack([jnp.zeros_like(qs[0])] + qs, axis=1)
    return static_tree(jnp.stack(tokens, axis=1), structure), q_btv, state


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree


def dynamic_scratch_size(depth: int, top_k: int) -> int:
    """Scratch slots used by :func:`draft_dynamic_tree`: the root plus top_k per depth 1..D-1."""
    return 1 + (depth - 1) * top_k


def draft_dynamic_tree(expand_fn: ExpandFn, state: Any, root_token_b: jax.Array, *,
                       depth: int, top_k: int, n_nodes: int,
                       d2t_v: Optional[jax.Array] = None
                       ) -> Tuple[DraftTree, jax.Array, Any]:
    """EAGLE-2 dynamic tree with static shapes; returns ``(tree, cum_logp_bt, state)``.

    Depth 1 holds the root's top_k children. From each of the top_k frontier nodes at depth d the
    draft proposes its top_k children (top_k^2 candidates); the top_k by cumulative draft
    log-probability become the next frontier (expanded only if d+1 < depth). From the pool of
    all candidates (top_k + (depth-1)*top_k^2), the top ``n_nodes - 1`` by cumulative
    log-probability are kept together with the root, in pool order, which is topological and
    keeps siblings in draft (rank) order.

    Ancestors are always kept: a child's cumulative log-prob is its parent's plus a log-prob <= 0,
    so never larger, and ties go to the lower pool index, which the parent has. Nodes with
    cumulative log-prob -inf (the draft gives them zero mass) are marked invalid.
    """
    if depth < 1 or top_k < 1:
        raise ValueError(f"draft_dynamic_tree: need depth >= 1 and top_k >= 1, got depth={depth}, "
                         f"top_k={top_k}")
    pool = top_k + (depth - 1) * top_k * top_k
    if not 2 <= n_nodes <= pool + 1:
        raise ValueError(f"draft_dynamic_tree: n_nodes={n_nodes} must be in [2, {pool + 1}] "
                         f"(root + a pool of {pool} candidates for depth={depth}, top_k={top_k})")
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    b = root_token_b.shape[0]
    n_scratch = dynamic_scratch_size(depth, top_k)

    anc0 = jnp.zeros((b, 1, n_scratch), bool).at[:, :, 0].set(True)
    frontier = Frontier(root_token_b[:, None], jnp.zeros((b, 1), jnp.int32), anc0, 0, 0,
                        n_scratch)
    logp_bkv, state = expand_fn(state, frontier)
    _check_logp(logp_bkv, b, 1, 0)
    if top_k > logp_bkv.shape[-1]:
        raise ValueError(f"draft_dynamic_tree: top_k={top_k} exceeds the draft vocabulary "
                         f"({logp_bkv.shape[-1]})")
    cum_bk, idx_bk = jax.lax.top_k(logp_bkv[:, 0], top_k)
    tok_bk = _map_tokens(idx_bk, d2t_v)
    pool_tok = [tok_bk]
    pool_cum = [cum_bk]
    pool_parent = [jnp.full((b, top_k), -1, jnp.int32)]  # pool index of the parent, -1 = root
    front_pool_idx = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (b, top_k))
    front_parent_slot = jnp.zeros((b, top_k), jnp.int32)
    pool_offset = top_k
    prev_anc = anc0
    for d in range(1, depth):
        slot_offset = 1 + (d - 1) * top_k
        own = jax.nn.one_hot(slot_offset + jnp.arange(top_k), n_scratch, dtype=bool)  # [K,N]
        anc = jnp.take_along_axis(prev_anc, front_parent_slot[..., None], axis=1) | own[None]
        frontier = Frontier(tok_bk, front_parent_slot, anc, d, slot_offset, n_scratch)
        logp_bkv, state = expand_fn(state, frontier)
        _check_logp(logp_bkv, b, top_k, d)
        val_bkk, idx_bkk = top_k_lib.top_k(logp_bkv, top_k)
        cand_cum = (cum_bk[:, :, None] + val_bkk).reshape(b, top_k * top_k)
        cand_tok = _map_tokens(idx_bkk, d2t_v).reshape(b, top_k * top_k)
        cand_parent = jnp.repeat(front_pool_idx, top_k, axis=1)
        pool_tok.append(cand_tok)
        pool_cum.append(cand_cum)
        pool_parent.append(cand_parent)
        # next frontier: candidate j = slot*top_k + rank
        cum_bk, sel = top_k_lib.top_k(cand_cum, top_k)
        tok_bk = jnp.take_along_axis(cand_tok, sel, axis=1)
        front_parent_slot = sel // top_k
        front_pool_idx = pool_offset + sel
        pool_offset += top_k * top_k
        prev_anc = anc
    tree, cum_bt = _keep_top_nodes(root_token_b, jnp.concatenate(pool_tok, axis=1),
                                   jnp.concatenate(pool_cum, axis=1), jnp.concatenate(pool_parent, axis=1),
                                   n_nodes, depth)
    return tree, cum_bt, state


def _keep_top_nodes(root_token_b, pool_tok, pool_cum, pool_parent, n_nodes: int, depth: int):
    """EAGLE-2's final selection: the root plus the top ``n_nodes - 1`` pool candidates by
    cumulative draft log-probability, in pool order (topological, siblings in rank order)
    -> (tree, cum_logp_bt)."""
    b, pool = pool_tok.shape
    _, keep = top_k_lib.top_k(pool_cum, n_nodes - 1)
    keep = jnp.sort(keep, axis=1)  # pool order is topological
    rows = jnp.arange(b)[:, None]
    pool_to_node = jnp.full((b, pool), -1, jnp.int32).at[rows, keep].set(
        jnp.arange(1, n_nodes, dtype=jnp.int32))
    par_pool = jnp.take_along_axis(pool_parent, keep, axis=1)
    par_node = jnp.where(par_pool < 0, 0,
                         jnp.take_along_axis(pool_to_node, jnp.maximum(par_pool, 0), axis=1))
    cum_sel = jnp.take_along_axis(pool_cum, keep, axis=1)
    tokens_bt = jnp.concatenate([root_token_b[:, None], jnp.take_along_axis(pool_tok, keep, 1)], 1)
    parents_bt = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par_node], axis=1)
    cum_bt = jnp.concatenate([jnp.zeros((b, 1), cum_sel.dtype), cum_sel], axis=1)
    valid_bt = jnp.isfinite(cum_bt)
    # par_node == -1 would mean a dropped ancestor; build_tree then marks the node invalid
    return build_tree(tokens_bt, parents_bt, depth, valid_bt), cum_bt


# --------------------------------------------------------------------------------------------
# Trees over block drafts (DDTree): best-first over per-position top-k


def draft_block_tree(logp_bdv: jax.Array, root_token_b: jax.Array, *, n_nodes: int,
                     d2t_v: Optional[jax.Array] = None) -> Tuple[DraftTree, jax.Array]:
    """DDTree's best-first tree over a block draft; returns ``(tree, cum_logp_bt)``.

    ``logp_bdv`` [B,D,V]: the draft's log-probabilities of block position d+1 (the token d+1 after the
    root), which do not depend on the tokens drafted before it (DFlash's block, Medusa's heads). A node
    at depth d is (parent, rank r): the r-th best token of position d, scored by the sum of its path's
    log-probabilities. Best-first expansion (DDTree, arXiv 2604.12989): a heap starts with the root's
    first child; each of ``n_nodes - 1`` steps pops the best candidate into the tree and pushes its next
    sibling (same parent, rank r+1) and its first child (depth d+1, rank 0). Since a child scores no
    more than its parent and a sibling no more than its elder, the tree is the ``n_nodes - 1`` best nodes
    of the Cartesian tree of per-position top-k (k = ``n_nodes - 1``), prefix-closed.
    (:func:`draft_best_first_tree` with a distribution that ignores the parent.)
    """
    logp_bdv = jnp.asarray(logp_bdv, jnp.float32)
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    if logp_bdv.ndim != 3 or logp_bdv.shape[0] != root_token_b.shape[0]:
        raise ValueError(f"draft_block_tree: logp_bdv must be [B,D,V] with B = {root_token_b.shape[0]} roots; "
                         f"got {logp_bdv.shape}")
    b, depth, _ = logp_bdv.shape
    rows = jnp.arange(b)

    def children(tokens_b, depth_b, state):
        del tokens_b
        return logp_bdv[rows, jnp.minimum(depth_b, depth - 1)], state

    return draft_best_first_tree(children, root_token_b, n_nodes=n_nodes, depth=depth, d2t_v=d2t_v)


def draft_fanout_tree(logp_bdv: jax.Array, root_token_b: jax.Array, *, n_nodes: int, fanout: int,
                      d2t_v: Optional[jax.Array] = None) -> Tuple[DraftTree, jax.Array]:
    """JetSpec's ``accum_logp`` tree over a block draft; returns ``(tree, cum_logp_bt)``.

    Reference: hao-ai-lab/JetSpec ``jetspec/tree/baselines/accum_logp.py`` ``_build_from_topk`` at commit
    2c7b3fa (its default tree algorithm). ``logp_bdv`` [B,D,V] as :func:`draft_block_tree`'s. Every depth
    offers the same ``fanout`` candidates (position d's top-``fanout`` tokens, whatever the parent). A
    max-heap of nodes by cumulative log-probability starts with the root; each step pops the best node
    not yet expanded and, if its depth is below D, appends **all** its children at once — rank 0..fanout-1
    of the next position, in rank order, as many as the budget of ``n_nodes`` nodes (root included) still
    holds. Unlike DDTree's best-first nodes, a popped node's whole fan joins the tree. Ties pop the node
    inserted first (the reference's insertion counter); nodes come out in insertion order, which is
    topological with siblings in rank order.

    Static shapes: ``n_nodes - 1`` expansion steps, each an argmax over the [B, n_nodes] nodes not yet
    expanded and above depth D (a node at depth D would be popped and dropped by the reference, which adds
    nothing and changes no later pop), then a scatter of ``fanout`` children at the row's node count
    (past the budget: dropped). A row with nothing left to expand adds nothing."""
    logp_bdv = jnp.asarray(logp_bdv, jnp.float32)
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    if logp_bdv.ndim != 3 or logp_bdv.shape[0] != root_token_b.shape[0]:
        raise ValueError(f"draft_fanout_tree: logp_bdv must be [B,D,V] with B = {root_token_b.shape[0]} roots; "
                         f"got {logp_bdv.shape}")
    if n_nodes < 2 or fanout < 1:
        raise ValueError(f"draft_fanout_tree: n_nodes={n_nodes} must be >= 2 and fanout={fanout} >= 1")
    b, depth, v = logp_bdv.shape
    k = min(int(fanout), v)
    top_val, top_idx = top_k_lib.top_k(logp_bdv, k)  # [B,D,k]
    top_tok = _map_tokens(top_idx, d2t_v)
    rows = jnp.arange(b)
    nodes = dict(token=jnp.zeros((b, n_nodes), jnp.int32).at[:, 0].set(root_token_b),
                 parent=jnp.full((b, n_nodes), -1, jnp.int32), depth=jnp.zeros((b, n_nodes), jnp.int32),
                 cum=jnp.full((b, n_nodes), -jnp.inf, jnp.float32).at[:, 0].set(0.0),
                 open=jnp.zeros((b, n_nodes), bool).at[:, 0].set(True), count=jnp.ones((b,), jnp.int32))
    ranks = jnp.arange(k)

    def expand(_, nodes):
        score = jnp.where(nodes["open"] & (nodes["depth"] < depth), nodes["cum"], -jnp.inf)
        j = jnp.argmax(score, axis=1)  # first maximum: the node inserted first
        live = jnp.isfinite(score[rows, j])
        d = nodes["depth"][rows, j]
        dd = jnp.minimum(d, depth - 1)
        slot = nodes["count"][:, None] + ranks[None]  # [B,k]
        slot = jnp.where(live[:, None] & (slot < n_nodes), slot, n_nodes)  # n_nodes: dropped
        put = lambda x, val: x.at[rows[:, None], slot].set(val, mode="drop")  # noqa: E731
        nodes = dict(token=put(nodes["token"], top_tok[rows, dd]),
                     parent=put(nodes["parent"], jnp.broadcast_to(j[:, None], (b, k))),
                     depth=put(nodes["depth"], jnp.broadcast_to((d + 1)[:, None], (b, k))),
                     cum=put(nodes["cum"], nodes["cum"][rows, j][:, None] + top_val[rows, dd]),
                     open=put(nodes["open"].at[rows, j].set(jnp.where(live, False, nodes["open"][rows, j])),
                              jnp.ones((b, k), bool)),
                     count=jnp.where(live, jnp.minimum(nodes["count"] + k, n_nodes), nodes["count"]))
        return nodes

    nodes = jax.lax.fori_loop(0, n_nodes - 1, expand, nodes)
    valid = jnp.arange(n_nodes)[None] < nodes["count"][:, None]
    tree = build_tree(nodes["token"], nodes["parent"], depth, valid)
    return tree, jnp.where(valid, nodes["cum"], -jnp.inf)


def draft_best_first_tree(children_fn, root_token_b: jax.Array, *, n_nodes: int, depth: int,
                          d2t_v: Optional[jax.Array] = None, state0=None) -> Tuple[DraftTree, jax.Array]:
    """DDTree's best-first tree for a draft whose next-token distribution may depend on the node it
    follows; returns ``(tree, cum_logp_bt)``.

    ``children_fn(tokens_b, depth_b, state) -> (logp_bv, state)``: the draft's log-probabilities [B,V] of
    the token after a node whose (target-vocabulary) token is ``tokens_b`` at depth ``depth_b`` [B], and the
    per-node state its children need (``state``: the parent's; a pytree of [B,...] arrays, or None) — e.g.
    DSpark's block slot ``depth_b`` plus its Markov bias from ``tokens_b``. Called once for the root and once
    per popped node (a [B,V] distribution and its top-k, inside a ``fori_loop``).

    A node is (parent, rank r): the r-th best token of its parent's distribution, scored by the sum of its
    path's log-probabilities. A heap starts with the root's first child; each of ``n_nodes - 1`` steps pops
    the best candidate into the tree, computes its children's distribution, and pushes its next sibling
    (rank r+1 under the same parent) and its first child (rank 0 of its own distribution, if its depth is
    below ``depth``). A child never outscores its parent nor a sibling its elder, so the tree is the
    ``n_nodes - 1`` best nodes of the tree of every node's top-k (k = ``n_nodes - 1``), prefix-closed.

    Static shapes: the heap is a buffer of 1 + 2(T-1) candidate slots (pop i pushes into slots 2i+1,
    2i+2), a pop an argmax over it (ties: the earliest push); every node keeps its top-k [B,T,k]. Nodes
    come out in pop order, which is topological and puts siblings in rank order (``decode.verify``'s
    sequential rule visits them so); a pop with no finite candidate left (zero draft mass) is an invalid node.
    """
    root_token_b = jnp.asarray(root_token_b, jnp.int32)
    b = root_token_b.shape[0]
    if n_nodes < 2 or depth < 1:
        raise ValueError(f"draft_best_first_tree: n_nodes={n_nodes} must be >= 2 (the root and one draft) and "
                         f"depth={depth} >= 1")
    rows = jnp.arange(b)
    logp0, state0 = children_fn(root_token_b, jnp.zeros((b,), jnp.int32), state0)
    k = min(n_nodes - 1, logp0.shape[-1])

    def top(logp_bv):
        val, idx = top_k_lib.top_k(jnp.asarray(logp_bv, jnp.float32), k)
        return val, _map_tokens(idx, d2t_v)

    val0, tok0 = top(logp0)
    n_slots = 1 + 2 * (n_nodes - 1)
    neg = jnp.float32(-jnp.inf)
    per_node = lambda x: jnp.zeros((b, n_nodes) + x.shape[1:], x.dtype).at[:, 0].set(x)  # noqa: E731
    nodes = dict(token=per_node(root_token_b), parent=jnp.full((b, n_nodes), -1, jnp.int32),
                 depth=jnp.zeros((b, n_nodes), jnp.int32), cum=jnp.zeros((b, n_nodes), jnp.float32),
                 val=per_node(val0), tok=per_node(tok0), state=jax.tree_util.tree_map(per_node, state0))
    # candidate slots: score, the parent's score, parent node, rank
    heap = dict(score=jnp.full((b, n_slots), neg).at[:, 0].set(val0[:, 0]), base=jnp.zeros((b, n_slots), jnp.float32),
                parent=jnp.zeros((b, n_slots), jnp.int32), rank=jnp.zeros((b, n_slots), jnp.int32))

    def pop(i, carry):
        heap, nodes = carry
        j = jnp.argmax(heap["score"], axis=1)  # first maximum: the earliest push wins a tie
        s, base, par, r = (heap[f][rows, j] for f in ("score", "base", "parent", "rank"))
        node = i + 1
        token = nodes["tok"][rows, par, r]
        d = nodes["depth"][rows, par] + 1
        parent_state = jax.tree_util.tree_map(lambda x: x[rows, par], nodes["state"])
        logp, state = children_fn(token, d, parent_state)
        val, tok = top(logp)
        live = jnp.isfinite(s)
        nodes = dict(token=nodes["token"].at[:, node].set(token), parent=nodes["parent"].at[:, node].set(par),
                     depth=nodes["depth"].at[:, node].set(d), cum=nodes["cum"].at[:, node].set(s),
                     val=nodes["val"].at[:, node].set(val), tok=nodes["tok"].at[:, node].set(tok),
                     state=jax.tree_util.tree_map(lambda a, x: a.at[:, node].set(x), nodes["state"], state))
        r1 = jnp.minimum(r + 1, k - 1)
        sib = jnp.where(live & (r + 1 < k), base + nodes["val"][rows, par, r1], neg)
        child = jnp.where(live & (d < depth), s + val[:, 0], neg)
        a, c = 2 * i + 1, 2 * i + 2
        heap = dict(score=heap["score"].at[rows, j].set(neg).at[:, a].set(sib).at[:, c].set(child),
                    base=heap["base"].at[:, a].set(base).at[:, c].set(s),
                    parent=heap["parent"].at[:, a].set(par).at[:, c].set(node),
                    rank=heap["rank"].at[:, a].set(r + 1).at[:, c].set(0))
        return heap, nodes

    _, nodes = jax.lax.fori_loop(0, n_nodes - 1, pop, (heap, nodes))
    cum_bt = nodes["cum"]
    tree = build_tree(nodes["token"], nodes["parent"], depth, jnp.isfinite(cum_bt))
    return tree, cum_bt
