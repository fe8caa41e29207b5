"""Draft attention: keys shared by all queries plus a small block of keys private to each query.

The target's attention (``kernels.attention_reference``) has one key set per row; the draft's
training-time test needs, per query, the entries of its own index at earlier TTT steps (the TTT
diagonal) and its own future entry, which a dense mask would make O(T · T·L_ttt). Here they are a
per-query block of X extra keys: O(T · X).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from confu_jax.kernels.attention_reference import NEG_INF


def draft_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, mask_bts: jax.Array,
                    k_btxhd: Optional[jax.Array] = None, v_btxhd: Optional[jax.Array] = None,
                    mask_btx: Optional[jax.Array] = None) -> jax.Array:
    """Softmax attention over keys shared by all queries [B,S] and per-query keys [B,T,X].

    The per-query block is what makes TTT's diagonal (query (j,s) sees entries (j,1..s) of its
    own index only) and per-position future entries cost O(T·X) instead of a dense [T, T·L] mask.
    float32 scores; a query that sees nothing returns zeros.
    """
    b, t, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    q = q_bthd.reshape(b, t, hkv, g, d).astype(jnp.float32) * (1.0 / d ** 0.5)
    s_sh = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd.astype(jnp.float32))
    s_sh = jnp.where(mask_bts[:, None, None], s_sh, NEG_INF)
    parts = [s_sh]
    if k_btxhd is not None:
        s_extra = jnp.einsum("btkgd,btxkd->bkgtx", q, k_btxhd.astype(jnp.float32))
        parts.append(jnp.where(mask_btx[:, None, None], s_extra, NEG_INF))
    s_all = jnp.concatenate(parts, axis=-1)
    m = jnp.max(s_all, axis=-1, keepdims=True)
    p = jnp.where(s_all <= NEG_INF / 2, 0.0, jnp.exp(s_all - m))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den == 0, 1.0, den)
    n_sh = k_bshd.shape[1]
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :n_sh], v_bshd.astype(jnp.float32))
    if k_btxhd is not None:
        out = out + jnp.einsum("bkgtx,btxkd->btkgd", p[..., n_sh:], v_btxhd.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q_bthd.dtype)
