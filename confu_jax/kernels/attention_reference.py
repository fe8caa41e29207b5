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

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class AttendTo:
    """What a block of queries attends to, beside its own keys: one struct for every attention path
    (the reference, the blockwise XLA form, the Pallas kernel, their dispatch) and every forward that
    calls them (``models.llama.Llama``, its unrolled mirror, the draft models).

    Per layer (the kernels): ``mask`` [B,T,T] over the block's own keys (True = visible); ``k_cache`` /
    ``v_cache`` [B,Hkv,S,D] (head-major, ``models.kv_cache``) with ``cache_len`` [B,T] or [B] visible
    slots and ``cache_start`` [B,T] or [B] (optional: the first visible slot, 0 if None — packed training
    rows, where a contemplate query sees only its own segment's slots); ``k_prefix`` / ``v_prefix``
    [P,Hkv,D] (ConFu's soft prompts, shared over the batch) seen by queries with ``prefix_visible`` [B,T].
    In a model's forward the cache and prefix carry a leading layer axis ([L,B,Hkv,S,D], or the cache
    as a list of per-layer buffers; [L,P,Hkv,D]), sliced per layer by the forward, and ``mask`` may be
    None (causal) or a ``kernels.flash_attention.CausalSegments``. A pytree: it crosses ``jit`` and
    ``scan`` as its arrays."""

    mask: Any = None
    k_cache: Any = None
    v_cache: Any = None
    cache_len: Optional[jax.Array] = None
    cache_start: Optional[jax.Array] = None
    k_prefix: Any = None
    v_prefix: Any = None
    prefix_visible: Optional[jax.Array] = None

    @property
    def has_cache(self) -> bool:
        """A cache with slots (a per-layer one: [B,Hkv,S,D] with S > 0)."""
        return self.k_cache is not None and self.k_cache.shape[2] > 0

    @property
    def has_prefix(self) -> bool:
        """A prefix with entries (a per-layer one: [P,Hkv,D] with P > 0)."""
        return self.k_prefix is not None and self.k_prefix.shape[0] > 0


jax.tree_util.register_dataclass(AttendTo, data_fields=[f.name for f in dataclasses.fields(AttendTo)],
                                 meta_fields=[])


def masked_attention_reference(q_bthd: jax.Array, k_blk_bthd: jax.Array, v_blk_bthd: jax.Array,
                               to: AttendTo) -> jax.Array:
    """Softmax attention over [cache | prefix | block] keys (``to``, per layer); GQA by head grouping.

    Shapes: q [B,T,Hq,D]; block K/V [B,T,Hkv,D]; the rest as :class:`AttendTo` says.
    Scores and softmax are computed in float32; the output has q's dtype.
    A query that sees no key at all returns zeros (never NaN).
    """
    block_mask_btt, k_cache_bhsd, v_cache_bhsd, cache_len_bt = to.mask, to.k_cache, to.v_cache, to.cache_len
    k_prefix_phd, v_prefix_phd, prefix_visible_bt, cache_start_bt = to.k_prefix, to.v_prefix, to.prefix_visible, \
        to.cache_start
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
