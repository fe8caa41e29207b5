"""The reference masked attention: the one definition every attention path is checked against.

Every use of the target (full sequence, prefill, AR decode, tree verification with contemplate
tokens, ConFu's training-form contemplate queries) is one call of the same function over three key
blocks:

* the committed **cache** — each query sees cache slots ``[0, cache_len_bt[b, t])``;
* an optional **prefix** (ConFu soft prompts) — seen only by queries with ``prefix_visible_bt``;
* the **block** of keys computed from the queries' own tokens — seen under ``block_mask_btt``.

Keeping the blocks separate (rather than one dense mask over a concatenation) is what lets tree
verification score candidates without writing them into the cache, lets the Pallas kernel skip
whole regions, and keeps the training form at N+K instead of 2N tokens.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def masked_attention_reference(
    q_bthd: jax.Array,
    k_blk_bthd: jax.Array,
    v_blk_bthd: jax.Array,
    block_mask_btt: jax.Array,
    k_cache_bhsd: Optional[jax.Array] = None,
    v_cache_bhsd: Optional[jax.Array] = None,
    cache_len_bt: Optional[jax.Array] = None,
    k_prefix_phd: Optional[jax.Array] = None,
    v_prefix_phd: Optional[jax.Array] = None,
    prefix_visible_bt: Optional[jax.Array] = None,
    cache_start_bt: Optional[jax.Array] = None,
) -> jax.Array:
    """Softmax attention over [cache | prefix | block] keys; GQA by head grouping.

    Shapes: q [B,T,Hq,D]; block K/V [B,T,Hkv,D]; block_mask [B,T,T] (True = visible);
    cache K/V [B,Hkv,S,D] (head-major, ``models.kv_cache``); cache_len [B,T] or [B] (number of
    visible cache slots); cache_start [B,T] or [B] (optional: the first visible slot, 0 if None —
    packed training rows, where a contemplate query sees only its own segment's slots);
    prefix K/V [P,Hkv,D] (shared over the batch); prefix_visible [B,T].
    Scores and softmax are computed in float32; the output has q's dtype.
    A query that sees no key at all returns zeros (never NaN).
    """
    b, t, hq, d = q_bthd.shape
    hkv = k_blk_bthd.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    g = hq // hkv
    scale = 1.0 / (d ** 0.5)
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32) * scale

    def scores(k_bshd):  # -> [B, Hkv, G, T, S]
        return jnp.einsum("btkgd,bskd->bkgts", q, k_bshd.astype(jnp.float32))

    parts_s, parts_v = [], []
    if k_cache_bhsd is not None and k_cache_bhsd.shape[2] > 0:
        k_cache_bshd = jnp.swapaxes(k_cache_bhsd, 1, 2)
        s_len = k_cache_bshd.shape[1]
        lens = jnp.asarray(cache_len_bt)
        if lens.ndim == 1:
            lens = jnp.broadcast_to(lens[:, None], (b, t))
        vis = jnp.arange(s_len)[None, None, :] < lens[:, :, None]  # [B,T,S]
        if cache_start_bt is not None:
            start = jnp.asarray(cache_start_bt)
            start = jnp.broadcast_to(start[:, None], (b, t)) if start.ndim == 1 else start
            vis = vis & (jnp.arange(s_len)[None, None, :] >= start[:, :, None])
        parts_s.append(jnp.where(vis[:, None, None], scores(k_cache_bshd), NEG_INF))
        parts_v.append(jnp.swapaxes(v_cache_bhsd, 1, 2))
    if k_prefix_phd is not None and k_prefix_phd.shape[0] > 0:
        p_len = k_prefix_phd.shape[0]
        kp = jnp.broadcast_to(k_prefix_phd[None], (b,) + k_prefix_phd.shape)
        vp = jnp.broadcast_to(v_prefix_phd[None], (b,) + v_prefix_phd.shape)
        vis = jnp.broadcast_to(prefix_visible_bt[:, :, None], (b, t, p_len))
        parts_s.append(jnp.where(vis[:, None, None], scores(kp), NEG_INF))
        parts_v.append(vp)
    parts_s.append(jnp.where(block_mask_btt[:, None, None], scores(k_blk_bthd), NEG_INF))
    parts_v.append(v_blk_bthd)

    s = jnp.concatenate(parts_s, axis=-1)
    v = jnp.concatenate([p.astype(jnp.float32) for p in parts_v], axis=1)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    p = jnp.where(s <= NEG_INF / 2, 0.0, p)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v)
    return out.reshape(b, t, hq, d).astype(q_bthd.dtype)
