"""The XLA attention every target forward runs by default: one softmax over [cache | prefix | block]
computed block by block, never concatenated.

Same contract as ``attention_reference.masked_attention_reference`` (the definition it is tested
against), organised for memory traffic rather than readability:

* each key block gets its own partial softmax state — row maximum ``m``, mass ``l`` and unnormalised
  output ``o`` — and the states are merged by their maxima (the flash-decoding epilogue). Nothing
  builds a [T, S + P + T] score tensor or a concatenated copy of V, and the cache is read in place;
* operands stay in their own dtype (bf16 caches are read as bf16) and every dot accumulates in
  float32 (``preferred_element_type``); the 1/sqrt(d) scale is applied to the float32 scores;
* the soft-prompt prefix [P, Hkv, D] is shared over the batch and is never broadcast to [B, P, ...];
* long blocks (prefill) are processed ``q_chunk`` queries at a time under ``lax.map``, so the block
  scores are [chunk, T] instead of [T, T] (an 8k-token prompt on Llama-3.1-8B would otherwise
  build ~8.6 GB of scores per layer).

Differentiable (training runs it); GQA by head grouping; a query that sees no key returns zeros.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from confu_jax.kernels.attention_reference import NEG_INF, AttendTo

Q_CHUNK = 512  # queries per chunk when a block is longer than this (prefill)


def softmax_block_state(s_bkgts, visible, v, v_spec: str):
    """(o [B,Hkv,G,T,D] f32 unnormalised, m [B,Hkv,G,T], l [B,Hkv,G,T]) of one key block: its
    float32 scores ``s_bkgts``, which of them are ``visible`` (broadcastable), and its values
    ``v`` laid out as ``v_spec`` says (einsum letters over b, k (KV head), s (key), d)."""
    s = jnp.where(visible, s_bkgts, NEG_INF)
    m = jnp.max(s, axis=-1)
    # masked scores are NEG_INF, so exp makes them exactly 0 without a second select over the
    # [T, S] scores (one pass fewer); a row with no visible key (m = NEG_INF) shifts by 0 instead
    p = jnp.exp(s - jnp.where(m > NEG_INF / 2, m, 0.0)[..., None])
    b, k, g, t, n = p.shape
    o = jnp.einsum(f"bkqs,{v_spec}->bkqd", p.astype(v.dtype).reshape(b, k, g * t, n), v,
                   preferred_element_type=jnp.float32)
    return o.reshape(b, k, g, t, -1), m, jnp.sum(p, axis=-1)


def _scores(q_bkgtd, keys, k_spec: str):
    """float32 q·k of every query against one key block laid out as ``k_spec`` -> [B,Hkv,G,T,S].

    The dot runs on the queries with G and T merged ([B,Hkv,G*T,D], a free reshape): XLA:CPU ran the
    5-D form "bkgtd,bksd->bkgts" far slower at T = 1 (a decode step's cache attention: 1.4x at
    B = 32, 5x at B = 48, S = 768), the 4-D form at the memory-bound speed."""
    b, k, g, t, d = q_bkgtd.shape
    s = jnp.einsum(f"bkqd,{k_spec}->bkqs", q_bkgtd.reshape(b, k, g * t, d), keys.astype(q_bkgtd.dtype),
                   preferred_element_type=jnp.float32)
    return s.reshape(b, k, g, t, -1)


def cache_block_state(q_bkgtd, k_bhsd, v_bhsd, visible_bts, scale):
    """``softmax_block_state`` of the queries against a head-major cache block [B,Hkv,S,D], computed
    key-major: scores as K·qᵀ [B,Hkv,S,G*T] (the cache is the dot's left operand, read in its own
    layout), softmax over S, then pᵀ·V. XLA:CPU's dot library transposed the whole K block into a
    scratch copy for the query-major q·Kᵀ before every dot (29% of a B = 32, S = 768 decode step);
    as the left operand K needs no transpose, only the small q and p do."""
    b, k, g, t, d = q_bkgtd.shape
    q_bkqd = q_bkgtd.reshape(b, k, g * t, d)
    s = jax.lax.dot_general(k_bhsd.astype(q_bkgtd.dtype), q_bkqd, (((3,), (3,)), ((0, 1), (0, 1))),
                            preferred_element_type=jnp.float32) * scale  # [B,Hkv,S,G*T]
    n = s.shape[2]
    vis = jnp.broadcast_to(jnp.swapaxes(visible_bts, 1, 2)[:, None, :, None, :], (b, 1, n, g, t))
    s = jnp.where(vis.reshape(b, 1, n, g * t), s, NEG_INF)
    m = jnp.max(s, axis=2)  # [B,Hkv,G*T]
    p = jnp.exp(s - jnp.where(m > NEG_INF / 2, m, 0.0)[:, :, None, :])
    o = jax.lax.dot_general(p.astype(v_bhsd.dtype), v_bhsd, (((2,), (2,)), ((0, 1), (0, 1))),
                            preferred_element_type=jnp.float32)  # [B,Hkv,G*T,D]
    return o.reshape(b, k, g, t, -1), m.reshape(b, k, g, t), jnp.sum(p, axis=2).reshape(b, k, g, t)


def merge_block_states(parts):
    """Combine per-block softmax states; rows that saw nothing get zeros."""
    m_all = parts[0][1]
    for _, m, _ in parts[1:]:
        m_all = jnp.maximum(m_all, m)
    o_sum, l_sum = 0.0, 0.0
    for o, m, l in parts:
        w = jnp.exp(m - m_all)  # a block with no visible key has l = 0 and o = 0
        o_sum = o_sum + w[..., None] * o
        l_sum = l_sum + w * l
    return o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]


def _attend(q_bkgtd, k_blk_bthd, v_blk_bthd, block_mask_btt, k_cache_bhsd, v_cache_bhsd,
            cache_len_bt, k_prefix_phd, v_prefix_phd, prefix_visible_bt, scale, cache_start_bt=None):
    """One query chunk against all key blocks -> [B,Hkv,G,T,D] float32."""
    parts = []
    if k_cache_bhsd is not None:
        s_len = k_cache_bhsd.shape[2]
        vis = jnp.arange(s_len)[None, None, :] < cache_len_bt[:, :, None]  # [B,T,S]
        if cache_start_bt is not None:  # packed rows: a query's own segment only
            vis = vis & (jnp.arange(s_len)[None, None, :] >= cache_start_bt[:, :, None])
        parts.append(cache_block_state(q_bkgtd, k_cache_bhsd, v_cache_bhsd, vis, scale))
    if k_prefix_phd is not None:
        # The shared prefix (ConFu's soft prompts) is broadcast over the batch so that its dots have the
        # block's batch dims (b, k): XLA:GPU (jaxlib 0.10.2) found no Triton tiling for the batch-free
        # form "bkqd,skd->bkqs" ("Couldn't find output tile sizes", every ConFu verification for an
        # H100, Llama-3.1-8B included: tests/compile). A few KiB per row, the same sums.
        b = q_bkgtd.shape[0]
        k_pre, v_pre = (jnp.broadcast_to(x[None], (b,) + x.shape) for x in (k_prefix_phd, v_prefix_phd))
        s = _scores(q_bkgtd, k_pre, "bskd") * scale
        parts.append(softmax_block_state(s, prefix_visible_bt[:, None, None, :, None], v_pre, "bskd"))
    s = _scores(q_bkgtd, k_blk_bthd, "bskd") * scale
    parts.append(softmax_block_state(s, block_mask_btt[:, None, None], v_blk_bthd, "bskd"))
    return merge_block_states(parts)


def masked_attention_blockwise(q_bthd: jax.Array, k_blk_bthd: jax.Array, v_blk_bthd: jax.Array, to: AttendTo,
                               *, q_chunk: int = Q_CHUNK) -> jax.Array:
    """``masked_attention_reference``'s contract (same shapes and arguments), block by block."""
    block_mask_btt, k_cache_bhsd, v_cache_bhsd, cache_len_bt = to.mask, to.k_cache, to.v_cache, to.cache_len
    k_prefix_phd, v_prefix_phd, prefix_visible_bt, cache_start_bt = to.k_prefix, to.v_prefix, to.prefix_visible, \
        to.cache_start
    b, t, hq, d = q_bthd.shape
    hkv = k_blk_bthd.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    g = hq // hkv
    scale = 1.0 / (d ** 0.5)
    has_cache = k_cache_bhsd is not None and k_cache_bhsd.shape[2] > 0
    has_prefix = k_prefix_phd is not None and k_prefix_phd.shape[0] > 0
    lens_bt = None
    if has_cache:
        if cache_len_bt is None:
            raise ValueError("cache_len_bt is required when a cache is given")
        lens_bt = jnp.asarray(cache_len_bt, jnp.int32)
        if lens_bt.ndim == 1:
            lens_bt = jnp.broadcast_to(lens_bt[:, None], (b, t))
    start_bt = None
    if has_cache and cache_start_bt is not None:
        start_bt = jnp.asarray(cache_start_bt, jnp.int32)
        if start_bt.ndim == 1:
            start_bt = jnp.broadcast_to(start_bt[:, None], (b, t))
    if has_prefix and prefix_visible_bt is None:
        raise ValueError("prefix_visible_bt is required when prefix K/V are given")
    q = q_bthd.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    cache = (k_cache_bhsd, v_cache_bhsd) if has_cache else (None, None)
    prefix = (k_prefix_phd, v_prefix_phd) if has_prefix else (None, None)

    if t <= q_chunk:
        out = _attend(q, k_blk_bthd, v_blk_bthd, block_mask_btt, *cache, lens_bt, *prefix,
                      prefix_visible_bt if has_prefix else None, scale, start_bt)
    else:
        # Query chunks: per-query inputs (q, mask rows, lengths, prefix visibility) are split,
        # keys are shared. Padded query rows see nothing and are dropped.
        n = -(-t // q_chunk)
        pad = n * q_chunk - t

        def chunks(x, axis):  # [.., T, ..] -> [n, .., C, ..]
            x = jnp.pad(x, [(0, pad) if i == axis else (0, 0) for i in range(x.ndim)])
            x = jnp.moveaxis(x, axis, 0).reshape((n, q_chunk) + x.shape[:axis] + x.shape[axis + 1:])
            return jnp.moveaxis(x, 1, axis + 1)

        xs = {"q": chunks(q, 3), "mask": chunks(block_mask_btt, 1)}
        if has_cache:
            xs["lens"] = chunks(lens_bt, 1)
        if has_prefix:
            xs["pvis"] = chunks(prefix_visible_bt, 1)
        if start_bt is not None:
            xs["start"] = chunks(start_bt, 1)

        def one(c):
            return _attend(c["q"], k_blk_bthd, v_blk_bthd, c["mask"], *cache, c.get("lens"), *prefix,
                           c.get("pvis"), scale, c.get("start"))

        out = jax.lax.map(one, xs)  # [n, B,Hkv,G,C,D]
        out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, n * q_chunk, d)[:, :, :, :t]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q_bthd.dtype)
