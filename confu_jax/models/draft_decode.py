"""The draft's incremental forward for the decode loop, and its one-layer KV cache.

During decoding the draft runs a few tokens at a time: the accepted tokens' first-step entries
(committed to the draft cache), then one tree level per call, attending the cache, the earlier
levels of this iteration's tree (a scratch buffer) and ConFu's transient future entry
(docs/DESIGN.md §5). ``draft_block`` computes and returns K/V but never writes anything.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.models.draft import DraftFuture, DraftHead, apply_head, draft_logits, embed_tokens
from confu_jax.models.draft_attention import draft_attention
from confu_jax.models.kv_cache import KVCache, init_cache
from confu_jax.models.spec import ModelSpec


class DraftBlockOutput(NamedTuple):
    logits_btv: jax.Array  # [B,T,V_draft] float32
    hidden_btd: jax.Array  # [B,T,d] final-normed
    h_out_btd: jax.Array  # [B,T,d] pre-norm output: the hidden input of these nodes' children
    k_new_bthd: jax.Array  # [B,T,Hkv,hd] this block's keys: commit (step-0 entries) or keep as scratch
    v_new_bthd: jax.Array


def init_draft_cache(spec: ModelSpec, batch: int, max_len: int) -> KVCache:
    """The draft's KV cache: a one-layer ``KVCache`` (commit with ``cache.commit(c, k[None], v[None], n)``)."""
    t = spec.target
    return init_cache(1, batch, max_len, t.n_kv_heads, t.head_dim, jnp.dtype(spec.head.dtype))


def draft_block(spec: ModelSpec, draft_params: dict, embed_vd: jax.Array, tokens_bt: jax.Array,
                hidden_btd: jax.Array, positions_bt: jax.Array, *, cache: Optional[KVCache] = None,
                block_mask_btt: Optional[jax.Array] = None, scratch_k_bmhd: Optional[jax.Array] = None,
                scratch_v_bmhd: Optional[jax.Array] = None, scratch_mask_btm: Optional[jax.Array] = None,
                future: Optional[DraftFuture] = None,
                future_visible_bt: Optional[jax.Array] = None) -> DraftBlockOutput:
    """Incremental draft forward of T inputs; never writes anything.

    Input i: (embed(tokens[i]), hidden[i]) at RoPE ``positions[i]``. It attends:
    * ``cache`` (one-layer ``KVCache``): slots < ``cache.length_b`` — committed step-0 entries of
      accepted tokens (input token x[j+1], hidden g[j], position j at slot j);
    * scratch [B,M]: K/V of earlier drafted tree nodes of this iteration, under ``scratch_mask_btm``
      (typically ancestors);
    * the block itself under ``block_mask_btt`` (default causal; a tree level: identity);
    * ``future`` ([B,1,Hkv,hd] from ``draft_future_entry``): visible to every query unless
      ``future_visible_bt`` says otherwise. It is transient: nothing returned contains it.

    Decode use: (1) after verification, run the accepted tokens' step-0 inputs (token x[j+1],
    g[j] from the verification's h_cat) as a causal block and commit their K/V; the output at the
    last one (the anchor p) gives the root's children. (2) Draft tree levels with hidden = the
    parents' ``h_out``, positions = parents' + 1, scratch = earlier levels' K/V.
    """
    if future is not None and not spec.head.has_future:
        raise ValueError("draft_block: variant 'eagle3' takes no future entry")
    b, t = tokens_bt.shape
    emb = embed_tokens(embed_vd, tokens_bt)
    q, k, v = apply_head(spec, draft_params, emb, hidden_btd, positions_bt.astype(jnp.int32), method=DraftHead.project)
    if block_mask_btt is None:
        block_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ks, vs, ms = [k], [v], [block_mask_btt]
    if scratch_k_bmhd is not None:
        ks.insert(0, scratch_k_bmhd)
        vs.insert(0, scratch_v_bmhd)
        ms.insert(0, scratch_mask_btm)
    if cache is not None:
        s = cache.max_len
        ks.insert(0, jnp.swapaxes(cache.k_lbhsd[0], 1, 2))  # the draft's attention is token-major
        vs.insert(0, jnp.swapaxes(cache.v_lbhsd[0], 1, 2))
        ms.insert(0, jnp.broadcast_to(jnp.arange(s)[None, None, :] < cache.length_b[:, None, None], (b, t, s)))
    ks = [x.astype(k.dtype) for x in ks]
    vs = [x.astype(v.dtype) for x in vs]
    ek = ev = em = None
    if future is not None:
        ek = jnp.broadcast_to(future.k_bnhd[:, :1][:, None], (b, t, 1) + k.shape[2:])
        ev = jnp.broadcast_to(future.v_bnhd[:, :1][:, None], (b, t, 1) + v.shape[2:])
        em = jnp.ones((b, t, 1), bool) if future_visible_bt is None else future_visible_bt[:, :, None]
    attn = draft_attention(q, jnp.concatenate(ks, 1), jnp.concatenate(vs, 1), jnp.concatenate(ms, 2), ek, ev, em)
    h_out, hidden = apply_head(spec, draft_params, attn, hidden_btd, method=DraftHead.finish)
    return DraftBlockOutput(draft_logits(spec, draft_params, hidden), hidden, h_out, k, v)
