"""One iteration's draft: ingest the accepted entries, then grow the tree level by level.

The tree drafters in ``decode.tree`` talk to the draft model through one callable,
``expand_fn(state, frontier) -> (logp_bkv, state)``; this module builds it for the EAGLE-3 /
ConFu draft head (docs/DESIGN.md §5):

* depth 0 (**ingest**): the pending entries of the ingestion buffer run as one causal block
  against the draft cache and are committed to it; the output at the last one (the anchor p)
  scores the root's children;
* depth k > 0 (**expand**): the frontier nodes feed (embed(node), parent's draft state) at draft
  position p+k, attend the draft cache, their ancestors' K/V in a per-iteration scratch buffer
  and themselves, and write their own K/V to the scratch.

For ConFu every draft query also sees the transient future entry built from f[p].
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode.plans import DraftPlan
from confu_jax.decode.spec_params import SpecParams
from confu_jax.decode.spec_state import SpecState
from confu_jax.models import draft as draft_lib
from confu_jax.models.draft_decode import draft_block
from confu_jax.models.kv_cache import KVCache, commit
from confu_jax.models.spec import ModelSpec


class DraftScratch(NamedTuple):
    """What ``expand_fn`` threads between depths."""

    draft_cache: KVCache  # the draft cache (the ingest step commits to it)
    scratch_k_bmhd: jax.Array  # [B, M, Hkv, hd] K of this iteration's expanded nodes (M scratch slots)
    scratch_v_bmhd: jax.Array
    h_out_bkd: jax.Array  # [B, K, d] draft state of the last frontier (its children's hidden input)


def future_entry(spec: ModelSpec, params: SpecParams, s: SpecState,
                 g_bad: Optional[jax.Array] = None) -> Optional[draft_lib.DraftFuture]:
    """ConFu's future entry for this iteration (token [f] = MoE_f(g[a]), hidden f[a], key at a+1,
    a = ``s.future_anchor_b``: p, or with sparse contemplates the deepest contemplated accepted
    node); None for EAGLE-3. ``g_bad``: fc of the ingestion buffer when the caller has it
    (``draft_tree`` computes it once for ingestion); a is one of the buffer's entries."""
    if not spec.head.has_future:
        return None
    rows = jnp.arange(s.future_anchor_b.shape[0])
    # the buffer holds entries p-n+1..p (n = ingest_count_b) and the cache length is p+1
    idx = s.future_anchor_b - (s.cache.length_b - s.ingest_count_b)
    if g_bad is None:
        g_anchor = draft_lib.draft_features(spec, params.draft, s.ingest_h_cat_bac[rows, idx])
    else:
        g_anchor = g_bad[rows, idx]
    return draft_lib.draft_future_entry(spec, params.draft, s.future_bd[:, None], g_anchor[:, None],
                                        s.future_anchor_b[:, None])


def ingest(spec: ModelSpec, params: SpecParams, s: SpecState, future, draft_cache: KVCache,
           g_bad: Optional[jax.Array] = None):
    """Depth 0: commit the pending entries to the draft cache -> (logits at the anchor [B,1,V_d],
    draft state at the anchor [B,1,d], updated draft cache). ``g_bad``: fc of the pending entries'
    h_cat when the caller computed it already. The LM head runs at the anchor row only."""
    b, a = s.ingest_tokens_ba.shape
    rows = jnp.arange(b)
    if g_bad is None:
        g_bad = draft_lib.draft_features(spec, params.draft, s.ingest_h_cat_bac)
    pos = draft_cache.length_b[:, None] + jnp.arange(a, dtype=jnp.int32)[None]
    last = s.ingest_count_b - 1
    out = draft_block(spec, params.draft, params.embed_vd, s.ingest_tokens_ba, g_bad, pos,
                      cache=draft_cache, future=future, logits_index_b=last)
    active = (~s.done_b).astype(jnp.int32)
    draft_cache = commit(draft_cache, out.k_new_bthd[None], out.v_new_bthd[None],
                         s.ingest_count_b * active)
    return out.logits_btv, out.h_out_btd[rows, last][:, None], draft_cache


def expand(spec: ModelSpec, params: SpecParams, st: DraftScratch, fr: tree_lib.Frontier,
           anchor_b: jax.Array, future):
    """Depth k > 0: draft the frontier's children -> (logits [B,K,V_d], updated scratch)."""
    b, k = fr.tokens_bk.shape
    h_in = jnp.take_along_axis(st.h_out_bkd, fr.parent_slot_bk[..., None], axis=1)
    pos = jnp.broadcast_to((anchor_b + fr.depth)[:, None], (b, k))
    slot = jnp.arange(fr.n_scratch)
    # slot 0 is the root's, whose K/V went to the draft cache at ingest; unwritten slots are masked
    usable = (slot > 0) & ((slot < fr.slot_offset) | (slot >= fr.slot_offset + k))
    out = draft_block(
        spec, params.draft, params.embed_vd, fr.tokens_bk, h_in, pos, cache=st.draft_cache,
        block_mask_btt=jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k)),
        scratch_k_bmhd=st.scratch_k_bmhd, scratch_v_bmhd=st.scratch_v_bmhd,
        scratch_mask_btm=fr.ancestor_bkn & usable[None, None], future=future)
    sk = jax.lax.dynamic_update_slice_in_dim(st.scratch_k_bmhd, out.k_new_bthd.astype(st.scratch_k_bmhd.dtype),
                                             fr.slot_offset, 1)
    sv = jax.lax.dynamic_update_slice_in_dim(st.scratch_v_bmhd, out.v_new_bthd.astype(st.scratch_v_bmhd.dtype),
                                             fr.slot_offset, 1)
    return out.logits_btv, DraftScratch(st.draft_cache, sk, sv, out.h_out_btd)


def draft_tree(spec: ModelSpec, params: SpecParams, plan: DraftPlan, s: SpecState, anchor_b: jax.Array,
               key: jax.Array, temperature, top_p):
    """Run the draft for one iteration -> (DraftTree, q_btv or None, updated draft cache,
    con_nodes_bm or None).

    ``q_btv`` (sampled chains only) holds the draft distributions the nodes were drawn from;
    ``con_nodes_bm`` [B,M] (ConFu with sparse contemplates only) the nodes that get one.
    """
    b = s.ingest_tokens_ba.shape[0]
    t = spec.target
    # fc(h_cat) of the pending entries, once: the future anchor's g also builds the future entry
    g_bad = draft_lib.draft_features(spec, params.draft, s.ingest_h_cat_bac)
    future = future_entry(spec, params, s, g_bad)
    scratch0 = jnp.zeros((b, plan.n_scratch, t.n_kv_heads, t.head_dim), jnp.dtype(spec.head.dtype))

    def expand_fn(st: DraftScratch, fr: tree_lib.Frontier):
        if fr.depth == 0:
            logits, h_out, draft_cache = ingest(spec, params, s, future, st.draft_cache, g_bad)
            st = st._replace(draft_cache=draft_cache, h_out_bkd=h_out)
        else:
            logits, st = expand(spec, params, st, fr, anchor_b, future)
        return jax.nn.log_softmax(logits, axis=-1), st

    st0 = DraftScratch(s.draft_cache, scratch0, scratch0,
                       jnp.zeros((b, 1, t.d_model), jnp.dtype(spec.head.dtype)))
    d2t = params.draft_vocab["d2t"]
    q = None
    score_bt = None
    if plan.kind == "dynamic":
        tree, score_bt, st = tree_lib.draft_dynamic_tree(expand_fn, st0, s.root_b, depth=plan.depth,
                                                         top_k=plan.top_k, n_nodes=plan.n_nodes, d2t_v=d2t)
    elif plan.kind == "sampled_chain":
        tree, q, st = tree_lib.draft_sampled_chain(expand_fn, st0, s.root_b, plan.k, key, temperature,
                                                   top_p, d2t_v=d2t, target_vocab=t.vocab_size)
    else:
        tree, st = tree_lib.draft_static_tree(expand_fn, st0, s.root_b, plan.structure(), d2t_v=d2t)
    con_nodes = contemplate_nodes(spec, plan, tree, score_bt)
    return tree, q, st.draft_cache, con_nodes


def contemplate_nodes(spec: ModelSpec, plan: DraftPlan, tree: tree_lib.DraftTree,
                      score_bt: Optional[jax.Array]) -> Optional[jax.Array]:
    """Sparse contemplates: the M nodes that get one -> [B,M] node indices in topological order,
    or None when every node gets one (EAGLE-3, or M = T).

    The M nodes the draft scores highest: by cumulative draft log-probability where the tree
    keeps it (dynamic trees; ties to the earlier node, so the root — score 0 — always comes
    first and a parent before its children), else the first M nodes (chains and static trees
    list nodes root-first, the draft's preferred children first). Invalid nodes score -inf.
    """
    m, t = plan.n_contemplates, tree.tokens_bt.shape[1]
    if not spec.head.has_future or m >= t:
        return None
    b = tree.tokens_bt.shape[0]
    if score_bt is None:
        return jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
    score = jnp.where(tree.valid_bt, score_bt, -jnp.inf).at[:, 0].set(0.0)
    _, idx = tree_lib.stable_top_k(score, m)
    return jnp.sort(idx, axis=1).astype(jnp.int32)
