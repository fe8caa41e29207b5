"""The speculative loop's carry and result (docs/DESIGN.md §3 for p, the root and draft entries)."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax

from confu_jax.models.kv_cache import KVCache


@flax.struct.dataclass(kw_only=True)
class SpecState:
    """State carried between iterations of the speculative while_loop; all device arrays.

    Per row, p is the last accepted position: the target cache holds positions 0..p and the root
    of the next tree is the bonus token x[p+1]. What the drafter keeps (a head's draft cache and
    ingestion buffer, a lookup drafter's token history) is its own pytree, ``drafter``
    (``decode.drafter``, docs/DESIGN.md §11).
    """

    tokens_bn: jax.Array  # [B, N] int32 output buffer (N = max_new_tokens), PAD_OUT past the end
    n_generated_b: jax.Array  # [B] int32 tokens emitted (prefill's first token included)
    done_b: jax.Array  # [B] bool
    reason_b: jax.Array  # [B] int32 StopReason
    cache: KVCache  # target cache [L, B, Hkv, S, hd], length p+1
    root_b: jax.Array  # [B] int32 the bonus token x[p+1]: root of the next tree
    drafter: Any  # the drafter's state (Drafter.init / propose / update)
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
