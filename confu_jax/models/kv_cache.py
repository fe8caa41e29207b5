"""Fixed-size target KV cache and the one way entries get into it.

The model forward never writes the cache (see ``confu_jax.models.llama``); callers commit the
entries they accept. Commits are scatters with ``mode='drop'``: a write past the end of the cache
is discarded, never clamped onto valid slots (``dynamic_update_slice`` would clamp).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    k_lbshd: jax.Array  # [L,B,S,Hkv,hd] post-RoPE keys
    v_lbshd: jax.Array
    length_b: jax.Array  # [B] int32: slots [0, length) are valid

    @property
    def max_len(self) -> int:
        return self.k_lbshd.shape[2]


def init_cache(n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
    shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, k_new_lbthd: jax.Array, v_new_lbthd: jax.Array, n_new_b: jax.Array,
           src_idx_bt: Optional[jax.Array] = None) -> KVCache:
    """Append ``n_new_b[b]`` entries per row at slots ``length[b]...``.

    Entry j of row b is ``k_new[:, b, src_idx_bt[b, j]]`` (default: j itself), so a tree
    verification commits its accepted path's nodes to contiguous slots. Entries j >= n_new and
    slots >= max_len are dropped; ``length`` is clipped to ``max_len``.
    """
    n_layers, b, t = k_new_lbthd.shape[:3]
    s = cache.max_len
    if src_idx_bt is None:
        src_idx_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    m = src_idx_bt.shape[1]
    rows = jnp.arange(b)[:, None]
    k_sel = k_new_lbthd[:, rows, src_idx_bt]  # [L,B,M,H,D]
    v_sel = v_new_lbthd[:, rows, src_idx_bt]
    j = jnp.arange(m)[None, :]
    slots = cache.length_b[:, None] + j
    slots = jnp.where(j < n_new_b[:, None], slots, s)  # s is out of bounds -> dropped
    k = cache.k_lbshd.at[:, rows, slots].set(k_sel.astype(cache.k_lbshd.dtype), mode="drop")
    v = cache.v_lbshd.at[:, rows, slots].set(v_sel.astype(cache.v_lbshd.dtype), mode="drop")
    length = jnp.minimum(cache.length_b + n_new_b.astype(jnp.int32), s)
    return KVCache(k, v, length)
