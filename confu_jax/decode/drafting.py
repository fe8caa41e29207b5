"""The EAGLE-3 / ConFu head as a ``Drafter``: ingest the accepted entries, then grow the tree level by level.

The tree drafters in ``decode.tree`` talk to the draft model through one callable,
``expand_fn(state, frontier) -> (logp_bkv, state)``; this module builds it for the EAGLE-3 /
ConFu draft head (docs/DESIGN.md §5) and wraps it as ``HeadDrafter`` (docs/DESIGN.md §11):

* depth 0 (**ingest**): the pending entries of the ingestion buffer run as one causal block
  against the draft cache and are committed to it; the output at the last one (the anchor p)
  scores the root's children;
* depth k > 0 (**expand**): the frontier nodes feed (embed(node), parent's draft state) at draft
  position p+k, attend the draft cache, their ancestors' K/V in a per-iteration scratch buffer
  and themselves, and write their own K/V to the scratch.

For ConFu every draft query also sees the transient future entry built from f[p].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode import cpu_packing
from confu_jax.decode import tree as tree_lib
from confu_jax.models import top_k as top_k_lib
from confu_jax.decode.drafter import DraftInput, PlanDrafter, PrefillView, Proposal, VerifiedPass
from confu_jax.decode.family import DrafterFamily, Method, source_path
from confu_jax.decode.loaded import LoadedDrafter, check_release, head_weights
from confu_jax.decode.plans import Chain, DraftPlan, parse_plan
from confu_jax.decode.params import DrafterParams, Target
from confu_jax.models import draft as draft_lib
from confu_jax.runs.exports import HEAD_FORMATS
from confu_jax.models.draft_decode import draft_block, init_draft_cache
from confu_jax.models.kv_cache import KVCache, commit
from confu_jax.models.spec import HeadConfig, ModelSpec


@flax.struct.dataclass(kw_only=True)
class HeadDraftState:
    """What an EAGLE-3 / ConFu head keeps between iterations (docs/DESIGN.md §3, §5).

    Per row, p is the last accepted position. The n draft entries whose h_cat the last
    verification produced (j = p-n+1..p, n = ``ingest_count_b`` <= A = D+1) wait in the
    **ingestion buffer**; the draft cache holds entries 0..p-n, and the next draft pass commits
    the buffer to it.
    """

    draft_cache: KVCache  # draft cache (one layer) [1, B, Hkv, S, hd], length p-n+1
    ingest_tokens_ba: jax.Array  # [B, A] int32 token slot x[j+1] of pending draft entries j = p-n+1..p
    ingest_h_cat_bac: jax.Array  # [B, A, 3d] their target features h_cat[j]
    ingest_count_b: jax.Array  # [B] int32 n, the number of valid pending entries (>= 1)
    future_bd: jax.Array  # [B, F] ConFu's future vector f[a] (F = d, 3d with future_taps; zeros, unused, for EAGLE-3)
    # [B] int32 a: the position whose contemplate made future_bd — p, or with sparse contemplates
    # the deepest contemplated node on the accepted path (p-n+1 <= a <= p); the future entry's anchor
    future_anchor_b: jax.Array


class DraftScratch(NamedTuple):
    """What ``expand_fn`` threads between depths."""

    draft_cache: KVCache  # the draft cache (the ingest step commits to it)
    scratch_k_bmhd: jax.Array  # [B, M, Hkv, hd] K of this iteration's expanded nodes (M scratch slots)
    scratch_v_bmhd: jax.Array
    h_out_bkd: jax.Array  # [B, K, d] draft state of the last frontier (its children's hidden input)


def future_entry(target: Target, dp: DrafterParams, hs: HeadDraftState, anchor_b: jax.Array,
                 g_bad: Optional[jax.Array] = None) -> Optional[draft_lib.DraftFuture]:
    """ConFu's future entry for this iteration (token [f] = MoE_f(g[a]), hidden f[a], key at a+1,
    a = ``hs.future_anchor_b``: p, or with sparse contemplates the deepest contemplated accepted
    node); None for EAGLE-3. ``anchor_b`` = p. ``g_bad``: fc of the ingestion buffer when the
    caller has it (``draft_tree`` computes it once for ingestion); a is one of the buffer's entries."""
    if not dp.has_future:
        return None
    spec = dp.spec(target.config)
    rows = jnp.arange(hs.future_anchor_b.shape[0])
    # the buffer holds entries p-n+1..p (n = ingest_count_b)
    idx = hs.future_anchor_b - (anchor_b + 1 - hs.ingest_count_b)
    if g_bad is None:
        g_anchor = draft_lib.draft_features(spec, dp.weights, hs.ingest_h_cat_bac[rows, idx])
    else:
        g_anchor = g_bad[rows, idx]
    return draft_lib.draft_future_entry(spec, dp.weights, hs.future_bd[:, None], g_anchor[:, None],
                                        hs.future_anchor_b[:, None])


# ----------------------------------------------------------------------------- any one-layer drafter with a cache
#
# ``block_fn(tokens_bt, hidden_btd, positions_bt, **attend) -> models.draft_decode.DraftBlockOutput`` is
# one incremental forward of the drafter's layer (``draft_block``'s contract: ``cache``,
# ``block_mask_btt``, scratch K/V and mask, ``logits_index_b``; it never writes anything). The EAGLE-3 /
# ConFu head and the MTP module (``decode.mtp``) draft through the functions below with their own
# ``block_fn``: an ingestion buffer of (token x[j+1], feature of position j) entries committed at depth
# 0, tree levels attending the cache, a scratch buffer of their ancestors' K/V and themselves.


def commit_prompt(block_fn, draft_cache: KVCache, view: PrefillView, feats_btd: jax.Array) -> KVCache:
    """Draft prefill: entries j = 0..n-2 (token x[j+1], feature ``feats_btd[j]``) as one causal
    block, committed (entry n-1 waits in the ingestion buffer: ``prompt_buffer``)."""
    b, width = view.tokens_bt.shape
    nxt = jnp.concatenate([view.tokens_bt[:, 1:], jnp.zeros((b, 1), view.tokens_bt.dtype)], axis=1)
    out = block_fn(nxt, feats_btd, jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width)))
    return commit(draft_cache, out.k_new_bthd[None], out.v_new_bthd[None], view.lengths_b - 1)


def prompt_buffer(view: PrefillView, feats_btc: jax.Array, a: int):
    """The ingestion buffer after the prompt: entry n-1 (the first emitted token, ``feats_btc[n-1]``)
    in an A-slot buffer -> (tokens [B,A], features [B,A,C], count [B] = 1)."""
    b = view.tokens_bt.shape[0]
    rows = jnp.arange(b)
    tokens = jnp.zeros((b, a), jnp.int32).at[:, 0].set(view.first_b)
    feats = jnp.zeros((b, a, feats_btc.shape[-1]), feats_btc.dtype).at[:, 0].set(feats_btc[rows, view.lengths_b - 1])
    return tokens, feats, jnp.ones((b,), jnp.int32)


def ingest_entries(block_fn, tokens_ba: jax.Array, feats_bac: jax.Array, count_b: jax.Array, done_b: jax.Array,
                   draft_cache: KVCache):
    """Depth 0: commit the ``count_b`` pending entries to the draft cache -> (logits at the anchor
    [B,1,V], draft state at the anchor [B,1,d], updated draft cache). The LM head runs at the anchor
    row only; rows that are done commit nothing."""
    b, a = tokens_ba.shape
    rows = jnp.arange(b)
    pos = draft_cache.length_b[:, None] + jnp.arange(a, dtype=jnp.int32)[None]
    last = count_b - 1
    out = block_fn(tokens_ba, feats_bac, pos, cache=draft_cache, logits_index_b=last)
    active = (~done_b).astype(jnp.int32)
    draft_cache = commit(draft_cache, out.k_new_bthd[None], out.v_new_bthd[None], count_b * active)
    return out.logits_btv, out.h_out_btd[rows, last][:, None], draft_cache


def expand_frontier(block_fn, st: DraftScratch, fr: tree_lib.Frontier, anchor_b: jax.Array):
    """Depth k > 0: draft the frontier's children -> (logits [B,K,V], updated scratch)."""
    b, k = fr.tokens_bk.shape
    h_in = jnp.take_along_axis(st.h_out_bkd, fr.parent_slot_bk[..., None], axis=1)
    pos = jnp.broadcast_to((anchor_b + fr.depth)[:, None], (b, k))
    slot = jnp.arange(fr.n_scratch)
    # slot 0 is the root's, whose K/V went to the draft cache at ingest; unwritten slots are masked
    usable = (slot > 0) & ((slot < fr.slot_offset) | (slot >= fr.slot_offset + k))
    out = block_fn(fr.tokens_bk, h_in, pos, cache=st.draft_cache,
                   block_mask_btt=jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k)),
                   scratch_k_bmhd=st.scratch_k_bmhd, scratch_v_bmhd=st.scratch_v_bmhd,
                   scratch_mask_btm=fr.ancestor_bkn & usable[None, None])
    sk = jax.lax.dynamic_update_slice_in_dim(st.scratch_k_bmhd, out.k_new_bthd.astype(st.scratch_k_bmhd.dtype),
                                             fr.slot_offset, 1)
    sv = jax.lax.dynamic_update_slice_in_dim(st.scratch_v_bmhd, out.v_new_bthd.astype(st.scratch_v_bmhd.dtype),
                                             fr.slot_offset, 1)
    return out.logits_btv, DraftScratch(st.draft_cache, sk, sv, out.h_out_btd)


def draft_cached_tree(plan: DraftPlan, block_fn, draft_cache: KVCache, tokens_ba: jax.Array, feats_bac: jax.Array,
                      count_b: jax.Array, inp: DraftInput, *, n_kv_heads: int, head_dim: int, d_model: int,
                      dtype, d2t_v=None, target_vocab: Optional[int] = None, ingest_block_fn=None):
    """One iteration of a one-layer drafter with a cache: ingest the buffer (depth 0), then the plan's
    tree level by level -> (DraftTree, q_btv or None, cumulative draft scores [B,T] or None (sampled
    chains), the draft cache with the buffer committed). ``ingest_block_fn``: depth 0's block function
    where it differs from the tree levels' (ConFu's ``future_input``); default ``block_fn``."""
    b = tokens_ba.shape[0]
    ingest_block_fn = block_fn if ingest_block_fn is None else ingest_block_fn

    def expand_fn(st: DraftScratch, fr: tree_lib.Frontier):
        if fr.depth == 0:
            logits, h_out, cache = ingest_entries(ingest_block_fn, tokens_ba, feats_bac, count_b, inp.done_b, st.draft_cache)
            st = st._replace(draft_cache=cache, h_out_bkd=h_out)
        else:
            logits, st = expand_frontier(block_fn, st, fr, inp.anchor_b)
        return jax.nn.log_softmax(logits, axis=-1), st

    scratch0 = jnp.zeros((b, plan.n_scratch, n_kv_heads, head_dim), jnp.dtype(dtype))
    st0 = DraftScratch(draft_cache, scratch0, scratch0, jnp.zeros((b, 1, d_model), jnp.dtype(dtype)))
    tree, q, score_bt, st = plan.grow(expand_fn, st0, inp, d2t_v=d2t_v, target_vocab=target_vocab)
    return tree, q, score_bt, st.draft_cache


def refill_entries(v: VerifiedPass, node_feats_btc: jax.Array, tokens_ba: jax.Array, feats_bac: jax.Array,
                   count_b: jax.Array):
    """The ingestion buffer after a verification: the accepted path's emitted tokens and its nodes'
    features (``node_feats_btc``: one per verified node); rows that were not active keep theirs ->
    (tokens [B,A], features [B,A,C], count [B])."""
    ver, active = v.verification, v.active_b
    keep = active[:, None]
    path = jnp.maximum(ver.path_bd, 0)
    feats_path = jnp.take_along_axis(node_feats_btc, path[..., None], axis=1)
    return (jnp.where(keep, jnp.maximum(ver.emitted_bd, 0), tokens_ba),
            jnp.where(keep[..., None], feats_path.astype(feats_bac.dtype), feats_bac),
            jnp.where(active, ver.n_accepted_b, count_b))


# ----------------------------------------------------------------------------- the EAGLE-3 / ConFu head


def head_block(target: Target, dp: DrafterParams, future=None, future_input_bd=None):
    """The head's ``block_fn`` (``draft_block`` on its parameters, with ConFu's future entry, and at
    ingestion what f adds to the first step's input: ``future_input``). The draft reads the target's
    embeddings, or its own where it has trained a copy (``draft['embed_tokens']``: an imported P-EAGLE
    head, ``weights.peagle_format``)."""
    draft = dp.weights
    embed = draft["embed_tokens"] if "embed_tokens" in draft else target.embed_vd
    draft = {k: v for k, v in draft.items() if k != "embed_tokens"}
    return functools.partial(draft_block, dp.spec(target.config), draft, embed, future=future,
                             future_input_bd=future_input_bd)


def future_input(target: Target, dp: DrafterParams, hs: HeadDraftState) -> Optional[jax.Array]:
    """[B,d] what this iteration's f adds to the first draft step's input (``HeadConfig.future_input``), or None."""
    if not dp.head.future_input:
        return None
    return draft_lib.draft_future_input(dp.spec(target.config), dp.weights, hs.future_bd[:, None])[:, 0]


def ingest(target: Target, dp: DrafterParams, hs: HeadDraftState, done_b: jax.Array, future,
           draft_cache: KVCache, g_bad: Optional[jax.Array] = None):
    """Depth 0: commit the pending entries to the draft cache -> (logits at the anchor [B,1,V_d],
    draft state at the anchor [B,1,d], updated draft cache). ``g_bad``: fc of the pending entries'
    h_cat when the caller computed it already. The LM head runs at the anchor row only."""
    if g_bad is None:
        g_bad = draft_lib.draft_features(dp.spec(target.config), dp.weights, hs.ingest_h_cat_bac)
    block = head_block(target, dp, future, future_input(target, dp, hs) if future is not None else None)
    return ingest_entries(block, hs.ingest_tokens_ba, g_bad, hs.ingest_count_b, done_b, draft_cache)


def expand(target: Target, dp: DrafterParams, st: DraftScratch, fr: tree_lib.Frontier,
           anchor_b: jax.Array, future):
    """Depth k > 0: draft the frontier's children -> (logits [B,K,V_d], updated scratch)."""
    return expand_frontier(head_block(target, dp, future), st, fr, anchor_b)


def draft_tree(target: Target, dp: DrafterParams, plan: DraftPlan, hs: HeadDraftState, inp: DraftInput,
               with_scores: bool = False):
    """Run the draft for one iteration -> (DraftTree, q_btv or None, updated draft cache,
    con_nodes_bm or None), and with ``with_scores`` (static trees and chains) the nodes'
    cumulative draft log-probabilities [B,T] last.

    ``q_btv`` (sampled chains only) holds the draft distributions the nodes were drawn from;
    ``con_nodes_bm`` [B,M] (ConFu with sparse contemplates only) the nodes that get one.
    """
    t = target.config
    # fc(h_cat) of the pending entries, once: the future anchor's g also builds the future entry
    g_bad = draft_lib.draft_features(dp.spec(t), dp.weights, hs.ingest_h_cat_bac)
    future = future_entry(target, dp, hs, inp.anchor_b, g_bad)
    tree, q, score_bt, draft_cache = draft_cached_tree(
        plan, head_block(target, dp, future), hs.draft_cache, hs.ingest_tokens_ba, g_bad, hs.ingest_count_b, inp,
        n_kv_heads=t.n_kv_heads, head_dim=t.head_dim, d_model=t.d_model, dtype=dp.head.dtype,
        d2t_v=dp.draft_vocab["d2t"], target_vocab=t.vocab_size,
        ingest_block_fn=head_block(target, dp, future, future_input(target, dp, hs)))
    con_nodes = contemplate_nodes(dp.has_future, plan, tree, None if plan.nodes_ranked else score_bt)
    if with_scores:
        return tree, q, draft_cache, con_nodes, (score_bt if plan.nodes_ranked else None)
    return tree, q, draft_cache, con_nodes


class ContemplateInputs(NamedTuple):
    """ConFu's inputs to the target's verification pass (``models.target.verify`` keywords), carried through
    the generic loop as ``Proposal.verify_inputs``: what every contemplate's [con] reads, and with sparse
    contemplates the nodes that get one."""

    con_src_bc: jax.Array  # [B,3d] h_cat[p]
    con_nodes_bm: Optional[jax.Array]  # [B,M] node indices, or None: a contemplate after every node

    def truncated(self, width: int) -> "ContemplateInputs":
        """The same inputs for the tree's first ``width`` nodes: dense contemplates follow the nodes; sparse
        ones index the full tree."""
        del width
        if self.con_nodes_bm is not None:
            raise ValueError("truncate_proposal: sparse contemplates need the full tree width")
        return self


def contemplate_nodes(has_future: bool, plan: DraftPlan, tree: tree_lib.DraftTree,
                      score_bt: Optional[jax.Array]) -> Optional[jax.Array]:
    """Sparse contemplates: the M nodes that get one -> [B,M] node indices in topological order,
    or None when every node gets one (``has_future`` false: EAGLE-3; or M = T).

    The M nodes the draft scores highest: by cumulative draft log-probability where the tree
    keeps it (dynamic trees; ties to the earlier node, so the root — score 0 — always comes
    first and a parent before its children), else the first M nodes (chains and static trees
    list nodes root-first, the draft's preferred children first). Invalid nodes score -inf.
    """
    m, t = plan.n_contemplates, tree.tokens_bt.shape[1]
    if not has_future or m >= t:
        return None
    b = tree.tokens_bt.shape[0]
    if score_bt is None:
        return jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
    score = jnp.where(tree.valid_bt, score_bt, -jnp.inf).at[:, 0].set(0.0)
    _, idx = top_k_lib.top_k(score, m)
    return jnp.sort(idx, axis=1).astype(jnp.int32)


def _future_source(tree, last_node_b: jax.Array, con_nodes_bm) -> jax.Array:
    """Index of the contemplate whose f the next iteration uses: the last accepted node's own, or
    with sparse contemplates that of its deepest contemplated ancestor-or-self (the root always
    has one) -> [B] index into the verification's contemplates."""
    if con_nodes_bm is None:
        return last_node_b
    rows = jnp.arange(last_node_b.shape[0])
    on_path_bm = jnp.take_along_axis(tree.ancestor_btt[rows, last_node_b], con_nodes_bm, axis=1)
    depth_bm = jnp.take_along_axis(tree.depth_bt, con_nodes_bm, axis=1)
    return jnp.argmax(jnp.where(on_path_bm, depth_bm, -1), axis=1)


@dataclasses.dataclass(frozen=True)
class HeadDrafter(PlanDrafter):
    """A trained (or random) EAGLE-3 / ConFu head drafting the trees of ``plan`` (chain, sampled
    chain, static or EAGLE-2 dynamic tree; ``+cM`` sparse contemplates for ConFu). The variant —
    and so whether verification runs contemplates — is ``DrafterParams.head``.

    ``min_prob`` (chains only; plan text ``chain:K@P``): **confidence-gated width**. A row wants
    verified only the leading drafts whose cumulative draft probability is at least P, and the
    loop compiles every width 1..K+1 and verifies the narrowest that holds every active row's
    (docs/DESIGN.md §11): on a CPU, where a pass over K+1 tokens costs far more than an AR step,
    a head then spends verification only where it is confident, and an unconfident iteration
    costs one AR step. P = 0 (the default) always verifies the full chain.
    """

    plan: DraftPlan
    min_prob: float = 0.0
    what = "an EAGLE-3 / ConFu head"
    contemplates = True  # +cM: sparse contemplates (ConFu heads; EAGLE-3 heads ignore it)

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"HeadDrafter.min_prob must lie in [0, 1), got {self.min_prob}")
        if self.min_prob > 0 and not isinstance(self.plan, Chain):
            raise ValueError(f"confidence-gated width (@P) needs a chain:K plan, got {self.plan.text}")

    @property
    def widths(self) -> tuple:
        return tuple(range(1, self.n_nodes + 1)) if self.min_prob > 0 else (self.n_nodes,)

    def init(self, target: Target, dp: DrafterParams, view: PrefillView) -> HeadDraftState:
        """Draft prefill: entries j = 0..n-2 (token x[j+1], g[j]) as one causal block, committed;
        entry n-1 (token = the first emitted token, h_cat[n-1]) waits in the ingestion buffer."""
        b = view.tokens_bt.shape[0]
        spec = dp.spec(target.config)
        g_btd = draft_lib.draft_features(spec, dp.weights, view.h_cat_btc)
        draft_cache = commit_prompt(head_block(target, dp), init_draft_cache(spec, b, view.max_len), view, g_btd)
        tokens, h_cat, count = prompt_buffer(view, view.h_cat_btc, self.max_depth + 1)
        return HeadDraftState(
            draft_cache=draft_cache,
            ingest_tokens_ba=tokens,
            ingest_h_cat_bac=h_cat,
            ingest_count_b=count,
            future_bd=(view.future_bd if dp.has_future
                       else jnp.zeros((b, target.config.d_model), jnp.float32)),
            future_anchor_b=view.lengths_b - 1,  # the prefill contemplate follows the last prompt token
        )

    def propose(self, target: Target, dp: DrafterParams, hs: HeadDraftState, inp: DraftInput) -> Proposal:
        t = self.n_nodes
        if self.min_prob > 0:
            tree, q, draft_cache, con_nodes, score_bt = draft_tree(target, dp, self.plan, hs, inp, with_scores=True)
            # a chain's cumulative score falls with depth: the confident drafts are a prefix
            confident = (score_bt >= jnp.log(self.min_prob)) & tree.valid_bt
            n = 1 + jnp.sum(confident[:, 1:], axis=1).astype(jnp.int32)
        else:
            tree, q, draft_cache, con_nodes = draft_tree(target, dp, self.plan, hs, inp)
            n = jnp.full(inp.root_b.shape, t, jnp.int32)
        rows = jnp.arange(inp.root_b.shape[0])
        inputs = (ContemplateInputs(hs.ingest_h_cat_bac[rows, hs.ingest_count_b - 1], con_nodes)  # h_cat[p]
                  if dp.has_future else None)
        return Proposal(tree, q, n, inputs, hs.replace(draft_cache=draft_cache))

    def update(self, target: Target, dp: DrafterParams, hs: HeadDraftState, v: VerifiedPass) -> HeadDraftState:
        """Refill the ingestion buffer with the accepted path (emitted tokens, the nodes' h_cat); for
        ConFu, f is that of the contemplate after the last accepted (contemplated) node."""
        ver, vo, tree, active = v.verification, v.target, v.tree, v.active_b
        rows = jnp.arange(active.shape[0])
        keep = active[:, None]
        tokens, h_cat, count = refill_entries(v, vo.h_cat_btc, hs.ingest_tokens_ba, hs.ingest_h_cat_bac,
                                              hs.ingest_count_b)
        future_new, future_anchor = hs.future_bd, hs.future_anchor_b
        if dp.has_future:
            con_nodes = v.verify_inputs.con_nodes_bm
            c = _future_source(tree, ver.last_node_b, con_nodes)
            future_new = vo.future_btd[rows, c]
            node = ver.last_node_b if con_nodes is None else con_nodes[rows, c]
            future_anchor = v.anchor_b + 1 + tree.depth_bt[rows, node]  # that node's position
        return hs.replace(
            ingest_tokens_ba=tokens,
            ingest_h_cat_bac=h_cat,
            ingest_count_b=count,
            future_bd=jnp.where(keep, future_new.astype(hs.future_bd.dtype), hs.future_bd),
            future_anchor_b=jnp.where(active, future_anchor, hs.future_anchor_b),
        )

    def describe(self) -> str:
        return self.plan.text + (f"@{self.min_prob:g}" if self.min_prob else "")


# ----------------------------------------------------------------------------- the family: plans and loading


def parse_head(text: str) -> HeadDrafter:
    """A head plan, optionally ``@P`` (confidence-gated width, chains only)."""
    body, at, prob = text.partition("@")
    plan = parse_plan(body)
    if not at:
        return HeadDrafter(plan)
    try:
        p = float(prob)
    except ValueError:
        raise ValueError(f"bad plan {text!r}: @P needs a probability in (0, 1), e.g. chain:4@0.5") from None
    if not 0 < p < 1:
        raise ValueError(f"bad plan {text!r}: @P needs a probability in (0, 1), got {p}")
    return HeadDrafter(plan, min_prob=p)


def random_head(variant: str, target_cfg, target_params: dict, seed: int = 0,
                draft_vocab_size: Optional[int] = None) -> LoadedDrafter:
    """An untrained head of ``variant`` (τ ≈ 1): lossless checks and cost measurements. Random heads
    draft over the whole target vocabulary (identity d2t), or its first ``draft_vocab_size`` ids — a
    trained head's draft LM head has that many rows."""
    from confu_jax.models.params import init_trainable
    from confu_jax.models.vocab_map import identity_draft_vocab

    v_draft = target_cfg.vocab_size if draft_vocab_size is None else draft_vocab_size
    if not 0 < v_draft <= target_cfg.vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {target_cfg.vocab_size}], got {v_draft}")
    from confu_jax.models.registry import get_variant

    mask = target_cfg.vocab_size - 1 if get_variant(variant).parallel else None  # P-EAGLE: the last id as mask
    head = HeadConfig(variant=variant, draft_vocab_size=v_draft, mask_token_id=mask)
    trainable = jax.device_get(init_trainable(ModelSpec(target_cfg, head), jax.random.PRNGKey(seed)))
    vocab = identity_draft_vocab(target_cfg.vocab_size, v_draft)
    return head_weights(target_cfg, target_params, head, trainable, vocab, False, f"random (seed {seed})")


def _trained_head(method, workdir: str, target_cfg, target_params: dict, step: Optional[int],
                  target_source: str) -> LoadedDrafter:
    """The head of a ``launch.train`` workdir or a release on this target (architecture and weights checked)."""
    import numpy as np

    from confu_jax.runs.heads import check_head_target, load_trained_head

    check_release(workdir, target_params)  # a released head (trainable-tree export)
    h = load_trained_head(workdir, step)
    if h.spec.head.variant not in method.variants:
        raise ValueError(f"{workdir} holds a {h.spec.head.variant!r} head; --method {method.name} needs one of "
                         f"{method.variants}")
    check_head_target(h, workdir, target_cfg, target_params, target_source)
    vocab = {"d2t": np.asarray(h.draft_vocab["d2t"], np.int32), "t2d": np.asarray(h.draft_vocab["t2d"])}
    return head_weights(target_cfg, target_params, h.spec.head, h.trainable, vocab, True, f"{workdir} (step {h.step})")


def _imported_head(method, directory: str, target_cfg, target_params: dict) -> LoadedDrafter:
    """An EAGLE-3 head in the official (SGLang / SpecForge) or speculators (vLLM) format
    (``weights.eagle3_formats``), checked against this target: width, heads, vocabulary, taps."""
    from confu_jax.weights.eagle3_formats import bind_to_target, load_head

    check_release(directory, target_params)
    imp = load_head(directory)
    if imp.head.variant not in method.variants:
        raise ValueError(f"{directory} holds an EAGLE-3 head ({imp.fmt} format); --method {method.name} needs one "
                         f"of {method.variants}: decode it with --method eagle3, or train ConFu from it (init_from)")
    spec, trainable, vocab = bind_to_target(imp, target_cfg, target_params)
    return head_weights(target_cfg, target_params, spec.head, trainable, vocab, True, f"{directory} ({imp.fmt} format)")


def load_head_weights(method, target_cfg, target_params, source, *, seed=0, step=None,
                      target_source="the loaded target", target_tokenizer=None) -> LoadedDrafter:
    """An EAGLE-3 / ConFu head (``DrafterFamily.load``): a ``launch.train`` workdir (``WORKDIR@STEP``),
    a release, a published EAGLE-3 layout, or, with no source, a random head of the method's first
    variant."""
    from confu_jax.weights.eagle3_formats import detect_format

    del target_tokenizer
    if not source:
        return random_head(method.variants[0], target_cfg, target_params, seed)
    path = source_path(source)
    if detect_format(path) is not None:
        return _imported_head(method, path, target_cfg, target_params)
    return _trained_head(method, path, target_cfg, target_params, step, target_source)


# on the CPU's unrolled path the head's dense projections are packed like the target's (decode.cpu_packing)
cpu_packing.register(HeadDrafter, lambda d: draft_lib.DENSE_NAMES)

FAMILIES = (DrafterFamily(
    "head", parse_head, load_head_weights,
    methods=(Method("eagle3", ("eagle3",), "speculative decoding with an EAGLE-3 head"),
             Method("confu", ("confu", "confu_nomoe", "confu_nomoe_norep"), "speculative decoding with a ConFu head"),
             Method("confu_nomoe", ("confu_nomoe", "confu_nomoe_norep"), "ConFu -MoE ablation"),
             Method("confu_nomoe_norep", ("confu_nomoe_norep",), "ConFu -MoE & replicate ablation")),
    reads_step=True, export_formats=HEAD_FORMATS),)
