"""Row utilities every training objective shares: how conversations sit in a batch's rows (one
right-padded conversation per row, or several packed ones with segment ids), shifts that never cross a
conversation boundary, and anchor sampling. ConFu / EAGLE-3 (``train.loss``), DFlash, MTP and the
others build their targets from these, not from each other's loss modules.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax import sharding as shd


def pin_rows(x):
    """Pin a [B, ...] activation to batch-sharded rows at a block boundary (no-op outside the
    sharded step compiler; see ``confu_jax.sharding.constrain``)."""
    return shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1))


class RowLayout(NamedTuple):
    """How conversations sit in the rows. All None: one right-padded conversation per row (the
    default). Packed rows (``data.pack``): several conversations per row, told apart by
    ``segment_ids`` (1, 2, ... per row; 0 = padding) with RoPE ``positions`` restarting at 0."""

    segment_ids_bn: Optional[jax.Array] = None  # [B,N] int32
    positions_bn: Optional[jax.Array] = None  # [B,N] int32 position inside the segment
    segment_start_bn: Optional[jax.Array] = None  # [B,N] int32 row index of the segment's first token


def row_layout(batch: dict) -> RowLayout:
    """The batch's :class:`RowLayout`; ``positions`` default to index − segment start."""
    if "segment_ids" not in batch:
        if "positions" in batch:
            raise ValueError("batch has 'positions' but no 'segment_ids'; packed batches carry both")
        return RowLayout()
    seg = batch["segment_ids"].astype(jnp.int32)
    if seg.shape != batch["tokens"].shape:
        raise ValueError(f"batch['segment_ids'] {seg.shape} and batch['tokens'] {batch['tokens'].shape} differ")
    b, n = seg.shape
    idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    boundary = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(boundary, idx, 0), axis=1)
    pos = batch["positions"].astype(jnp.int32) if "positions" in batch else idx - start
    return RowLayout(seg, pos, start)


def batch_arrays(batch: dict):
    """(tokens [B,N] int32, loss mask [B,N] bool with right padding removed) of a training batch."""
    tokens_bn = batch["tokens"].astype(jnp.int32)
    loss_mask_bn = batch["loss_mask"].astype(bool)
    if tokens_bn.shape != loss_mask_bn.shape:
        raise ValueError(f"batch['tokens'] {tokens_bn.shape} and batch['loss_mask'] {loss_mask_bn.shape} differ")
    if "attention_mask" in batch:
        loss_mask_bn = loss_mask_bn & batch["attention_mask"].astype(bool)
    return tokens_bn, loss_mask_bn


def shift_ahead(x_bn: jax.Array, s: int, fill) -> jax.Array:
    """[B,N]: x[:, n + s] at n (``fill`` past the end)."""
    b, n = x_bn.shape
    return jnp.concatenate([x_bn[:, s:], jnp.full((b, min(s, n)), fill, x_bn.dtype)], axis=1)[:, :n]


def same_segment_ahead(segment_ids_bn, s: int):
    """[B,N] bool: position n + s lies in n's segment (None: unpacked rows, always True)."""
    if segment_ids_bn is None:
        return None
    return shift_ahead(segment_ids_bn, s, -1) == segment_ids_bn


def sample_anchors(rng: jax.Array, candidates_bn: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """K positions per row uniformly without replacement among the candidates.

    Top-k of i.i.d. uniform scores (non-candidates scored -1) is a uniformly random k-subset of the
    candidates; slots beyond a row's candidate count come back invalid. Valid anchors are sorted
    ascending, invalid slots last (anchor 0).
    """
    b, n = candidates_bn.shape
    k = min(int(k), n)
    u = jax.random.uniform(rng, (b, n))
    score = jnp.where(candidates_bn, u, -1.0)
    top, idx = jax.lax.top_k(score, k)
    valid = top >= 0.0
    key = jnp.where(valid, idx, n)  # invalid slots sort last
    order = jnp.argsort(key, axis=1)
    idx = jnp.take_along_axis(idx, order, axis=1)
    valid = jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid
