"""Draft attention: keys shared by all queries plus a small block of keys private to each query.

The target's attention (``kernels.attention_reference``) has one key set per row; the draft's
training-time test needs, per query, the entries of its own index at earlier TTT steps (the TTT
diagonal) and its own future entry, which a dense mask would make O(T · T·L_ttt). Here they are a
per-query block of X extra keys: O(T · X).

Long rows are attended ``q_chunk`` queries at a time under ``lax.map``, each chunk rematerialised
in the backward pass: the [T, T] float32 scores of a TTT step (4.8 GB for 32 rows × 2048 tokens ×
9 heads) and their softmax were otherwise kept for the backward pass at every step, and they —
not the matrix work — made 64 rows of 2048 tokens run out of an H200's 139 GiB
(docs/RESULTS.md, "H200: the GPU campaign trains both heads").
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from confu_jax.kernels.attention_reference import NEG_INF


Q_CHUNK = 512  # queries per chunk for rows longer than this (training rows of 1024-2048 tokens)


def draft_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, mask_bts: jax.Array,
                    k_btxhd: Optional[jax.Array] = None, v_btxhd: Optional[jax.Array] = None,
                    mask_btx: Optional[jax.Array] = None, *, bias_hx: Optional[jax.Array] = None,
                    extra_weights: bool = False, q_chunk: Optional[int] = None):
    """Softmax attention over keys shared by all queries [B,S] and per-query keys [B,T,X].

    The per-query block is what makes TTT's diagonal (query (j,s) sees entries (j,1..s) of its
    own index only) and per-position future entries cost O(T·X) instead of a dense [T, T·L] mask.
    float32 scores; a query that sees nothing returns zeros. ``bias_hx`` [Hq, X]: a logit added to
    query head h's score of per-query key x (ConFu's learned future-entry bias, DESIGN.md §4).
    ``extra_weights``: also return the softmax weights of the per-query keys, [B,T,Hq,X] float32
    (what the draft gives its future entry: the future probe). ``q_chunk`` > 0 and T > q_chunk:
    queries in chunks (the last one padded with queries that see nothing), each recomputed in the
    backward pass, so only [chunk, S] scores exist at a time; 0: one dense pass; None: ``Q_CHUNK``
    (read at trace time).
    """
    if (bias_hx is not None or extra_weights) and k_btxhd is None:
        raise ValueError("draft_attention: bias_hx / extra_weights need per-query keys (k_btxhd)")
    q_chunk = Q_CHUNK if q_chunk is None else q_chunk
    t = q_bthd.shape[1]
    if q_chunk <= 0 or t <= q_chunk:
        out = _dense_attention(q_bthd, k_bshd, v_bshd, mask_bts, k_btxhd, v_btxhd, mask_btx, bias_hx)
        return out if extra_weights else out[0]
    n_c = -(-t // q_chunk)
    pad = n_c * q_chunk - t

    def chunks(x):  # [B, T, ...] -> [n_c, B, q_chunk, ...]; padding is zeros / False
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((x.shape[0], n_c, q_chunk) + x.shape[2:]), 1, 0)

    per_query = (k_btxhd, v_btxhd, mask_btx)
    xs = (chunks(q_bthd), chunks(mask_bts)) + (tuple(chunks(x) for x in per_query) if k_btxhd is not None else ())

    @jax.checkpoint
    def one(x):
        if k_btxhd is None:
            return _dense_attention(x[0], k_bshd, v_bshd, x[1])[0]
        out, w = _dense_attention(x[0], k_bshd, v_bshd, x[1], x[2], x[3], x[4], bias_hx)
        return (out, w) if extra_weights else out

    def unchunk(y):  # [n_c, B, q_chunk, ...] -> [B, T, ...]
        return jnp.moveaxis(y, 0, 1).reshape((y.shape[1], n_c * q_chunk) + y.shape[3:])[:, :t]

    res = jax.lax.map(one, xs)
    return (unchunk(res[0]), unchunk(res[1])) if extra_weights else unchunk(res)


def _dense_attention(q_bthd, k_bshd, v_bshd, mask_bts, k_btxhd=None, v_btxhd=None, mask_btx=None, bias_hx=None):
    """``draft_attention`` in one pass: [B, H, T, S] scores -> (out, per-query-key weights [B,T,Hq,X] or None)."""
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32) * (1.0 / d ** 0.5)
    s_sh = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd.astype(jnp.float32))
    s_sh = jnp.where(mask_bts[:, None, None], s_sh, NEG_INF)
    parts = [s_sh]
    if k_btxhd is not None:
        s_extra = jnp.einsum("btkgd,btxkd->bkgtx", q, k_btxhd.astype(jnp.float32))
        if bias_hx is not None:
            s_extra = s_extra + bias_hx.astype(jnp.float32).reshape(hkv, g, 1, -1)
        parts.append(jnp.where(mask_btx[:, None, None], s_extra, NEG_INF))
    s_all = jnp.concatenate(parts, axis=-1)
    m = jnp.max(s_all, axis=-1, keepdims=True)
    p = jnp.where(s_all <= NEG_INF / 2, 0.0, jnp.exp(s_all - m))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den == 0, 1.0, den)
    n_sh = k_bshd.shape[1]
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :n_sh], v_bshd.astype(jnp.float32))
    w_bthx = None
    if k_btxhd is not None:
        out = out + jnp.einsum("bkgtx,btxkd->btkgd", p[..., n_sh:], v_btxhd.astype(jnp.float32))
        w_bthx = jnp.moveaxis(p[..., n_sh:], 3, 1).reshape(b, t, hq, -1)
    return out.reshape(b, t, hq, d).astype(q_bthd.dtype), w_bthx


def draft_attention_flash(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array,
                          segment_ids_bt: Optional[jax.Array] = None, k_btxhd: Optional[jax.Array] = None,
                          v_btxhd: Optional[jax.Array] = None, mask_btx: Optional[jax.Array] = None, *,
                          bias_hx: Optional[jax.Array] = None, extra_weights: bool = False,
                          block_k: Optional[int] = None):
    """``draft_attention`` with the shared keys under the TTT mask's structure instead of its entries.

    The shared part of a TTT step's mask is causal within a segment (query j sees step-0 keys at
    indices <= j of its own conversation), so it runs as flash attention (``kernels.flash_attention``:
    memory linear in T, no [T, T] mask or scores, nothing per key block kept for the backward pass),
    returning its log-sum-exp; the per-query keys (the future entry, the diagonal of earlier steps:
    X of them) are scored densely, [T, X], and the two softmaxes are merged by log-sum-exp. Same
    values and gradients as ``draft_attention(q, k, v, causal & same-segment mask, ...)``.
    """
    from confu_jax.kernels.flash_attention import BLOCK_K, flash_attention

    if (bias_hx is not None or extra_weights) and k_btxhd is None:
        raise ValueError("draft_attention_flash: bias_hx / extra_weights need per-query keys (k_btxhd)")
    out_sh, lse_sh = flash_attention(q_bthd, k_bshd, v_bshd, segment_ids_bt=segment_ids_bt,
                                     block_k=BLOCK_K if block_k is None else block_k, return_lse=True)
    if k_btxhd is None:
        return out_sh
    b, t, hq, d = q_bthd.shape
    hkv = k_btxhd.shape[3]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32) * (1.0 / d ** 0.5)
    s_x = jnp.einsum("btkgd,btxkd->btkgx", q, k_btxhd.astype(jnp.float32))
    if bias_hx is not None:
        s_x = s_x + bias_hx.astype(jnp.float32).reshape(hkv, g, -1)
    vis = mask_btx[:, :, None, None, :]
    s_x = jnp.where(vis, s_x, NEG_INF).reshape(b, t, hq, -1)
    m_x = jnp.max(s_x, axis=-1)
    seen_x = m_x > NEG_INF / 2
    p_x = jnp.where(vis.reshape(b, t, 1, -1), jnp.exp(s_x - jnp.where(seen_x, m_x, 0.0)[..., None]), 0.0)
    l_x = jnp.sum(p_x, axis=-1)
    lse_x = jnp.where(seen_x, m_x + jnp.log(jnp.where(seen_x, l_x, 1.0)), NEG_INF)
    lse = jnp.logaddexp(lse_sh, lse_x)
    seen = (lse_sh > NEG_INF / 2) | seen_x
    lse_safe = jnp.where(seen, lse, 0.0)
    w_sh = jnp.where(lse_sh > NEG_INF / 2, jnp.exp(lse_sh - lse_safe), 0.0)  # share of the shared keys
    w_x = jnp.where(vis.reshape(b, t, 1, -1), jnp.exp(s_x - lse_safe[..., None]), 0.0)  # each per-query key's weight
    o_x = jnp.einsum("btkgx,btxkd->btkgd", w_x.reshape(b, t, hkv, g, -1),
                     v_btxhd.astype(jnp.float32)).reshape(b, t, hq, d)  # grouped: V is never repeated per head
    out = (w_sh[..., None] * out_sh.astype(jnp.float32) + o_x).astype(q_bthd.dtype)
    return (out, w_x) if extra_weights else out
