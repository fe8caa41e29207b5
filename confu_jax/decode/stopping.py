"""What a decoding row emits and when it stops: one rule for AR and speculative decoding.

Both loops write tokens into a fixed [B, max_new_tokens] output buffer (``PAD_OUT`` past a row's
last token) and stop each row independently with the same priority: **EOS** (the EOS token is
emitted and counted, like Hugging Face ``generate``), then **max_new_tokens**, then **cache
full** — the cache could not hold what the row must feed next (one token for AR; the next
verification's D+1 nodes for speculative decoding, docs/DESIGN.md §5). A done row keeps riding
along in the batch (static shapes) but commits nothing and writes no tokens.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

# Value of output slots past a row's last generated token (never a valid token id).
PAD_OUT = -1


class StopReason(enum.IntEnum):
    RUNNING = 0  # only inside the loops; every returned row has one of the reasons below
    EOS = 1
    MAX_NEW_TOKENS = 2
    CACHE_FULL = 3


def is_eos(tokens: jax.Array, eos_e: jax.Array) -> jax.Array:
    """Elementwise: is each token one of the EOS ids ``eos_e`` [E] (-1 entries match nothing)."""
    return jnp.any(tokens[..., None] == eos_e, axis=-1)


def update_stop(active_b: jax.Array, hit_eos_b: jax.Array, n_generated_b: jax.Array,
                cache_needed_b: jax.Array, done_b: jax.Array, reason_b: jax.Array, *,
                max_new_tokens: int, max_len: int):
    """Stop active rows after they emitted this step's tokens -> (done_b, reason_b).

    ``hit_eos_b``: an EOS was among the tokens emitted; ``n_generated_b``: tokens emitted so far
    (after this step); ``cache_needed_b``: cache slots the row's next step needs filled
    (AR: length + 1; speculative: length + D + 1). Priority: EOS, max_new_tokens, cache full.
    """
    reason_new = jnp.where(
        hit_eos_b, StopReason.EOS,
        jnp.where(n_generated_b >= max_new_tokens, StopReason.MAX_NEW_TOKENS,
                  jnp.where(cache_needed_b > max_len, StopReason.CACHE_FULL, StopReason.RUNNING)),
    ).astype(jnp.int32)
    newly_b = active_b & (reason_new != StopReason.RUNNING)
    return done_b | newly_b, jnp.where(newly_b, reason_new, reason_b)


def emit(tokens_bn, n_generated_b, tok_b, active_b):
    """Write ``tok_b`` at each active row's next output slot (inactive rows: dropped write)."""
    n = tokens_bn.shape[1]
    col_b = jnp.where(active_b, n_generated_b, n)  # n is out of bounds -> dropped
    tokens_bn = tokens_bn.at[jnp.arange(tokens_bn.shape[0]), col_b].set(tok_b, mode="drop")
    return tokens_bn, n_generated_b + active_b.astype(jnp.int32)
