"""The speculative loop's carry and result (docs/DESIGN.md §3 for p, the root and draft entries)."""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax

from confu_jax.models.kv_cache import KVCache


@flax.struct.dataclass(kw_only=True)
class SpecState:
    """State carried between iterations of the speculative while_loop; all device arrays.

    Per row, p is the last accepted position: the target cache holds positions 0..p and the root
    of the next tree is the bonus token x[p+1]. The n draft entries whose h_cat the last
    verification produced (j = p-n+1..p, n = ``ingest_count_b`` <= A = D+1) wait in the
    **ingestion buffer**; the draft cache holds entries 0..p-n, and the next draft pass commits
    the buffer to it.
    """

    tokens_bn: jax.Array  # [B, N] int32 output buffer (N = max_new_tokens), PAD_OUT past the end
    n_generated_b: jax.Array  # [B] int32 tokens emitted (prefill's first token included)
    done_b: jax.Array  # [B] bool
    reason_b: jax.Array  # [B] int32 StopReason
    cache: KVCache  # target cache [L, B, Hkv, S, hd], length p+1
    draft_cache: KVCache  # draft cache (one layer) [1, B, Hkv, S, hd], length p-n+1
    root_b: jax.Array  # [B] int32 the bonus token x[p+1]: root of the next tree
    ingest_tokens_ba: jax.Array  # [B, A] int32 token slot x[j+1] of pending draft entries j = p-n+1..p
    ingest_h_cat_bac: jax.Array  # [B, A, 3d] their target features h_cat[j]
    ingest_count_b: jax.Array  # [B] int32 n, the number of valid pending entries (>= 1)
    future_bd: jax.Array  # [B, d] ConFu's future vector f[a] (zeros, unused, for EAGLE-3)
    # [B] int32 a: the position whose contemplate made future_bd — p, or with sparse contemplates
    # the deepest contemplated node on the accepted path (p-n+1 <= a <= p); the future entry's anchor
    future_anchor_b: jax.Array
    accept_log_bi: jax.Array  # [B, N] int32 tokens emitted by the row's i-th verification pass
    n_passes_b: jax.Array  # [B] int32 verification passes so far
    iteration: jax.Array  # [] int32 loop iterations (the loop bound and the RNG fold)
    key: jax.Array  # PRNG key


class SpecResult(NamedTuple):
    tokens_bn: jax.Array  # [B, max_new_tokens] int32; PAD_OUT after n_generated_b
    n_generated_b: jax.Array  # [B]
    stop_reason_b: jax.Array  # [B] StopReason
    accept_log_bi: jax.Array  # [B, max_new_tokens] tokens emitted per target pass; 0 past n_passes
    n_passes_b: jax.Array  # [B] verification passes (prefill excluded)
