"""Flash-form attention for training: an online softmax over key blocks, memory linear in the row length.

The training forwards (the target's pass over a row, the draft's training-time-test steps) attend a
row to itself under a *structural* mask — causal, within one segment of a packed row — so neither
the [S, S] mask nor the [S, S] scores need to exist:

* forward: chunks of ``q_chunk`` queries, each one pass over key blocks of ``block_k`` keys carrying
  each query's running maximum, mass and unnormalised output (``kernels.blockwise_attention``'s
  state), so the live scores are [q_chunk, block_k], never [T, S];
* backward (``jax.custom_vjp``): the flash-attention recurrence — the forward keeps only its output
  and each query's log-sum-exp, and the backward recomputes every block's probabilities from them
  (``p = exp(s - lse)``), so no per-block residual is stored either;
* ``lse`` is an output with its own gradient, so a caller can merge further keys by log-sum-exp
  (the draft's per-query keys: its future entry and the diagonal of earlier TTT steps,
  ``models.draft_attention.draft_attention_flash``).

Visibility: key j is visible to query i iff ``j <= i`` (``causal``; indices in the row, not RoPE
positions, which restart per segment) and ``segment_q[i] == segment_k[j]`` when segment ids are
given; a query that sees no key returns zeros and ``lse = NEG_INF``. Dots run on the operands' dtype
with float32 accumulation; softmax statistics are float32. GQA by head grouping.

On an accelerator the same contract is what a fused kernel (cuDNN / Pallas flash attention on GPU,
splash attention on TPU) computes; this is the XLA form every backend runs, tested against the dense
definition (tests/unit/test_flash_attention.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.kernels.attention_reference import NEG_INF

BLOCK_K = 512  # keys per block
Q_CHUNK = 512  # queries per chunk: the live scores are [rows, heads, Q_CHUNK, BLOCK_K] float32


class CausalSegments(NamedTuple):
    """A [B, T, T] causal mask described by what it is made of instead of its T² entries: query i sees
    key j iff j <= i and, with ``segment_ids_bt`` [B, T] int (packed rows), both carry the same id.
    Passed where a block mask is expected (``models.llama``'s ``block_mask_btt``); paths that need the
    entries call :meth:`dense`."""

    segment_ids_bt: Optional[jax.Array] = None

    def dense(self, b: int, t: int) -> jax.Array:
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        if self.segment_ids_bt is None:
            return jnp.broadcast_to(causal, (b, t, t))
        seg = self.segment_ids_bt
        return causal & (seg[:, :, None] == seg[:, None, :])


def _visible(qi_t, kj_s, seg_q_bt, seg_k_bs, causal: bool, n_keys: int):
    """[B or 1, T, S] bool for query indices ``qi_t`` and key indices ``kj_s`` (keys >= n_keys are padding)."""
    vis = (kj_s < n_keys)[None, None, :]
    if causal:
        vis = vis & (kj_s[None, None, :] <= qi_t[None, :, None])
    if seg_q_bt is not None:
        vis = vis & (seg_q_bt[:, :, None] == seg_k_bs[:, None, :])
    return vis


def _blocks(x_bs, block_k: int, n_blocks: int):
    """[B, S, ...] -> [n_blocks, B, block_k, ...] (zero-padded)."""
    pad = n_blocks * block_k - x_bs.shape[1]
    x = jnp.pad(x_bs, [(0, 0), (0, pad)] + [(0, 0)] * (x_bs.ndim - 2))
    return jnp.moveaxis(x.reshape((x.shape[0], n_blocks, block_k) + x.shape[2:]), 1, 0)


def _scores(q_bkgtd, k_bskd, scale):
    return jnp.einsum("bkgtd,bskd->bkgts", q_bkgtd, k_bskd.astype(q_bkgtd.dtype),
                      preferred_element_type=jnp.float32) * scale


def _kv_blocks(k_bshd, v_bshd, seg_k_bs, block_k: int):
    n_blocks = -(-k_bshd.shape[1] // block_k)
    xs = {"k": _blocks(k_bshd, block_k, n_blocks), "v": _blocks(v_bshd, block_k, n_blocks),
          "j": jnp.arange(n_blocks * block_k, dtype=jnp.int32).reshape(n_blocks, block_k)}
    if seg_k_bs is not None:
        xs["seg"] = _blocks(seg_k_bs, block_k, n_blocks)
    return xs, n_blocks


def _q_chunks(x_bt, q_chunk: int, n_chunks: int):
    """[B, T, ...] -> [n_chunks, B, q_chunk, ...] (zero-padded; padded queries are dropped)."""
    return _blocks(x_bt, q_chunk, n_chunks)


def _unchunk(x_nbc, t: int):
    """[n, B, c, ...] -> [B, T, ...]."""
    n, b, c = x_nbc.shape[:3]
    return jnp.moveaxis(x_nbc, 0, 1).reshape((b, n * c) + x_nbc.shape[3:])[:, :t]


def _heads(x_bthx, hkv: int):
    """[B,T,Hq,...] -> [B,Hkv,G,T,...]."""
    b, t, hq = x_bthx.shape[:3]
    return jnp.moveaxis(x_bthx.reshape((b, t, hkv, hq // hkv) + x_bthx.shape[3:]), 1, 3)


def _unheads(x_bkgtx):
    """[B,Hkv,G,T,...] -> [B,T,Hq,...]."""
    b, k, g, t = x_bkgtx.shape[:4]
    return jnp.moveaxis(x_bkgtx, 3, 1).reshape((b, t, k * g) + x_bkgtx.shape[4:])


def _forward(q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, causal: bool, block_k: int, q_chunk: int):
    """Query chunks (``lax.map``) x key blocks (``lax.scan``): live scores [B,Hq,q_chunk,block_k]."""
    b, t, hq, d = q_bthd.shape
    s_len, hkv = k_bshd.shape[1], k_bshd.shape[2]
    g = hq // hkv
    scale = 1.0 / (d ** 0.5)
    kv, _ = _kv_blocks(k_bshd, v_bshd, seg_k_bs, block_k)
    n_q = -(-t // q_chunk)
    qs = {"q": _q_chunks(q_bthd, q_chunk, n_q),
          "i": jnp.arange(n_q * q_chunk, dtype=jnp.int32).reshape(n_q, q_chunk)}
    if seg_q_bt is not None:
        qs["seg"] = _q_chunks(seg_q_bt, q_chunk, n_q)

    def chunk(c):
        q = _heads(c["q"], hkv)  # [B,K,G,C,D]

        def body(carry, x):
            m, l, o = carry
            s = _scores(q, x["k"], scale)
            vis = _visible(c["i"], x["j"], c.get("seg"), x.get("seg"), causal, s_len)[:, None, None]
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(m_new > NEG_INF / 2, m_new, 0.0)
            p = jnp.where(vis, jnp.exp(s - shift[..., None]), 0.0)
            alpha = jnp.exp(jnp.where(m > NEG_INF / 2, m, shift) - shift)
            o = alpha[..., None] * o + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_bshd.dtype), x["v"],
                                                  preferred_element_type=jnp.float32)
            return (m_new, alpha * l + jnp.sum(p, axis=-1), o), None

        shape = (b, hkv, g, q_chunk)
        init = (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (d,), jnp.float32))
        (m, l, o), _ = jax.lax.scan(body, init, kv)
        seen = l > 0
        o = o / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return _unheads(o), _unheads(lse)

    out, lse = jax.lax.map(chunk, qs)
    return _unchunk(out, t), _unchunk(lse, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, causal, block_k, q_chunk):
    out, lse = _forward(q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, causal, block_k, q_chunk)
    return out.astype(q_bthd.dtype), lse


def _flash_fwd(q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, causal, block_k, q_chunk):
    out, lse = _forward(q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, causal, block_k, q_chunk)
    out = out.astype(q_bthd.dtype)
    return (out, lse), (q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, out, lse)


def _flash_bwd(causal, block_k, q_chunk, res, cts):
    """Query chunks (outer scan, carrying the dK / dV sums) x key blocks (inner scan, carrying the
    chunk's dQ), probabilities recomputed from the saved log-sum-exp: live [B,Hq,q_chunk,block_k]."""
    q_bthd, k_bshd, v_bshd, seg_q_bt, seg_k_bs, out, lse_bth = res
    d_out, d_lse = cts
    b, t, hq, d = q_bthd.shape
    s_len, hkv = k_bshd.shape[1], k_bshd.shape[2]
    scale = 1.0 / (d ** 0.5)
    # dL/ds_ij = p_ij (dp_ij - sum_j' p_ij' dp_ij' + dlse_i): delta_i = <do_i, o_i> - dlse_i
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse.astype(jnp.float32)
    kv, n_blocks = _kv_blocks(k_bshd, v_bshd, seg_k_bs, block_k)
    n_q = -(-t // q_chunk)
    qs = {"q": _q_chunks(q_bthd, q_chunk, n_q), "do": _q_chunks(d_out, q_chunk, n_q),
          "lse": _q_chunks(lse_bth, q_chunk, n_q), "delta": _q_chunks(delta, q_chunk, n_q),
          "i": jnp.arange(n_q * q_chunk, dtype=jnp.int32).reshape(n_q, q_chunk)}
    if seg_q_bt is not None:
        qs["seg"] = _q_chunks(seg_q_bt, q_chunk, n_q)
    # padded queries (index >= T) must contribute nothing: their lse reads NEG_INF
    qs["lse"] = jnp.where((qs["i"] < t)[:, None, :, None], qs["lse"], NEG_INF)

    def chunk(acc, c):
        q = _heads(c["q"], hkv)
        do = _heads(c["do"], hkv).astype(jnp.float32)
        lse, dlt = _heads(c["lse"], hkv), _heads(c["delta"], hkv)
        seen = lse > NEG_INF / 2

        def body(dq, x):
            s = _scores(q, x["k"], scale)
            vis = _visible(c["i"], x["j"], c.get("seg"), x.get("seg"), causal, s_len)[:, None, None] & seen[..., None]
            p = jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
            dv = jnp.einsum("bkgts,bkgtd->bskd", p, do)
            dp = jnp.einsum("bkgtd,bskd->bkgts", do, x["v"].astype(jnp.float32))
            ds = p * (dp - dlt[..., None]) * scale
            dq = dq + jnp.einsum("bkgts,bskd->bkgtd", ds, x["k"].astype(jnp.float32))
            dk = jnp.einsum("bkgts,bkgtd->bskd", ds, q.astype(jnp.float32))
            return dq, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), kv)
        return (acc[0] + dk, acc[1] + dv), _unheads(dq)

    zeros = jnp.zeros((n_blocks, b, block_k, hkv, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(chunk, (zeros, zeros), qs)

    zero = (lambda x: None if x is None else jnp.zeros(x.shape, jax.dtypes.float0))
    return (_unchunk(dq, t).astype(q_bthd.dtype), _unchunk(dk, s_len).astype(k_bshd.dtype),
            _unchunk(dv, s_len).astype(v_bshd.dtype), zero(seg_q_bt), zero(seg_k_bs))


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, *,
                    segment_ids_bt: Optional[jax.Array] = None, key_segment_ids_bs: Optional[jax.Array] = None,
                    causal: bool = True, block_k: int = BLOCK_K, q_chunk: int = Q_CHUNK,
                    return_lse: bool = False):
    """Softmax attention of queries [B,T,Hq,D] over keys / values [B,S,Hkv,D] under a structural mask.

    ``causal``: key j visible to query i iff j <= i (row indices). ``segment_ids_bt``: the queries'
    segment ids (packed rows); ``key_segment_ids_bs`` the keys' (default: the same array, a row
    attending to itself). Returns out [B,T,Hq,D] in q's dtype, and with ``return_lse`` each query
    head's log-sum-exp [B,T,Hq] float32 (NEG_INF where it sees nothing), differentiable.
    """
    b, t, hq, d = q_bthd.shape
    if k_bshd.shape != v_bshd.shape or k_bshd.shape[0] != b or k_bshd.shape[3] != d or hq % k_bshd.shape[2]:
        raise ValueError(f"flash_attention: expected q [B,T,Hq,D], k and v [B,S,Hkv,D] with Hkv dividing Hq; got "
                         f"q {q_bthd.shape}, k {k_bshd.shape}, v {v_bshd.shape}")
    seg_k = key_segment_ids_bs if key_segment_ids_bs is not None else segment_ids_bt
    if (segment_ids_bt is None) != (seg_k is None):
        raise ValueError("flash_attention: give segment ids for both queries and keys, or neither")
    if segment_ids_bt is not None:
        segment_ids_bt, seg_k = jnp.asarray(segment_ids_bt, jnp.int32), jnp.asarray(seg_k, jnp.int32)
    block_k = max(1, min(int(block_k), k_bshd.shape[1]))
    q_chunk = max(1, min(int(q_chunk), t))
    out, lse = _flash(q_bthd, k_bshd, v_bshd, segment_ids_bt, seg_k, bool(causal), block_k, q_chunk)
    return (out, lse) if return_lse else out
