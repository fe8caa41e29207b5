"""Fixed-size target KV cache and the one way entries get into it.

The model forward never writes the cache (see ``confu_jax.models.llama``); callers commit the
entries they accept. Commits are scatters with ``mode='drop'``: a write past the end of the cache
is discarded, never clamped onto valid slots (``dynamic_update_slice`` would clamp).

Layout: head-major, [L, B, Hkv, S, hd]. A decode step's attention reads, for each (row, KV head),
one contiguous [S, hd] slab of keys and one of values: the dot over the cache is a batched
[G*T, hd] x [hd, S] product with S the long axis. The forward's new entries are token-major
([L, B, T, Hkv, hd], ``LlamaOutput.k_new_lbthd``); commits transpose those few entries.

Storage: one stacked array per K and V (what the scanned forward's ``nn.scan`` slices, and what
GPU/TPU use), or — ``per_layer=True``, with the layer-unrolled CPU forward — a tuple of L separate
[B, Hkv, S, hd] buffers. On XLA:CPU reading layer i of a stacked cache materialises a copy of the
slice before every dot (a [B, Hkv, S, hd] copy per layer per step, all in fresh pages): at batch 32
and 768 slots that copy, not attention, was most of a decode step (docs/RESULTS.md). Per-layer
buffers are read in place and updated in place by the loops that carry them. Both forms hold the
same values; ``stacked`` gives the [L, ...] view of either.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp

Layers = Union[jax.Array, Sequence[jax.Array]]  # [L,B,Hkv,S,hd] or L x [B,Hkv,S,hd]


class KVCache(NamedTuple):
    k_lbhsd: Layers  # post-RoPE keys: [L,B,Hkv,S,hd], or a tuple of L [B,Hkv,S,hd] buffers
    v_lbhsd: Layers  # values, same form as the keys
    length_b: jax.Array  # [B] int32: slots [0, length) are valid

    @property
    def max_len(self) -> int:
        return self.k_lbhsd[0].shape[-2]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k_lbhsd, (tuple, list))


def stacked(kv: Layers) -> jax.Array:
    """The [L, B, Hkv, S, hd] array of either storage (a copy for per-layer buffers)."""
    return jnp.stack(kv) if isinstance(kv, (tuple, list)) else kv


def init_cache(n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
               dtype=jnp.float32, *, per_layer: bool = False) -> KVCache:
    shape = (batch, n_kv_heads, max_len, head_dim)
    if per_layer:
        kv = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n_layers))  # noqa: E731
        return KVCache(kv(), kv(), jnp.zeros((batch,), jnp.int32))
    shape = (n_layers,) + shape
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, k_new_lbthd: jax.Array, v_new_lbthd: jax.Array, n_new_b: jax.Array,
           src_idx_bt: Optional[jax.Array] = None) -> KVCache:
    """Append ``n_new_b[b]`` entries per row at slots ``length[b]...``.

    Entry j of row b is ``k_new[:, b, src_idx_bt[b, j]]`` (default: j itself), so a tree
    verification commits its accepted path's nodes to contiguous slots. Entries j >= n_new and
    slots >= max_len are dropped; ``length`` is clipped to ``max_len``.
    """
    b, t = k_new_lbthd.shape[1:3]
    s = cache.max_len
    if src_idx_bt is None:
        src_idx_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    m = src_idx_bt.shape[1]
    rows = jnp.arange(b)[:, None]
    j = jnp.arange(m)[None, :]
    slots = cache.length_b[:, None] + j
    slots = jnp.where(j < n_new_b[:, None], slots, s)  # s is out of bounds -> dropped

    def put(buf, new_lbthd):
        sel_lbmhd = new_lbthd[:, rows, src_idx_bt]
        if isinstance(buf, (tuple, list)):
            # advanced indices (rows, slots) around a slice: numpy puts their [B, M] axes first
            return tuple(x.at[rows, :, slots].set(sel_lbmhd[i].astype(x.dtype), mode="drop")
                         for i, x in enumerate(buf))
        upd_bmlhd = sel_lbmhd.transpose(1, 2, 0, 3, 4)
        return buf.at[:, rows, :, slots].set(upd_bmlhd.astype(buf.dtype), mode="drop")

    k = put(cache.k_lbhsd, k_new_lbthd)
    v = put(cache.v_lbhsd, v_new_lbthd)
    length = jnp.minimum(cache.length_b + n_new_b.astype(jnp.int32), s)
    return KVCache(k, v, length)


def to_cache_layout(kv_lbthd: jax.Array) -> jax.Array:
    """Token-major K or V of a forward ([L,B,T,Hkv,hd], slot i = position i) -> the cache's
    head-major [L,B,Hkv,T,hd] (ConFu's training form attends a real pass's K/V as a cache)."""
    return jnp.swapaxes(kv_lbthd, 2, 3)
