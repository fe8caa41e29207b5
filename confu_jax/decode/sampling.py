"""Logit processing shared by autoregressive and speculative decoding.

Speculative sampling is lossless only if the verifier's target distribution is exactly the one AR
decoding samples from; both paths therefore call ``target_probs`` and nothing else.
Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nucleus_threshold(probs_v: jax.Array, top_p) -> jax.Array:
    """The smallest kept probability of the nucleus, without sorting the vocabulary.

    Top-p keeps token i iff the mass strictly above it is below ``top_p``: with
    ``S(x) = sum(p[p > x])``, the threshold is the smallest probability ``p_i`` with
    ``S(p_i) < top_p`` and the kept set is ``p >= threshold`` (ties kept together). ``S`` only
    changes at the probabilities themselves and non-negative float32 values order like their bit
    patterns, so a bisection over the int32 bit patterns finds that threshold exactly in 31
    masked sums over the vocabulary — O(31 V) work against the O(V log V) sort it replaces, and
    none of it when ``top_p >= 1`` (see ``target_probs``). Returns [..., 1].
    """
    bits = jax.lax.bitcast_convert_type(probs_v.astype(jnp.float32), jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)

    def mass_above(x):  # S at bit pattern x, [..., 1]
        return jnp.sum(jnp.where(bits > x, probs_v, 0.0), axis=-1, keepdims=True)

    # invariant: S(hi) < top_p (nothing lies above the largest probability), S(lo - 1) >= top_p
    lo = jnp.zeros(bits.shape[:-1] + (1,), jnp.int32)
    hi = jnp.max(bits, axis=-1, keepdims=True)

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        below = mass_above(mid) < top_p
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    _, hi = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def target_probs(logits_v: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Probabilities over the last axis after temperature and nucleus (top-p) filtering.

    ``temperature`` and ``top_p`` may be traced scalars (one compiled loop serves all settings).
    Top-p keeps the smallest set of most-probable tokens whose mass reaches ``top_p`` (the token
    that crosses the threshold is kept), as Hugging Face's ``TopPLogitsWarper``; ties at the
    boundary are kept together. The nucleus costs nothing at ``top_p >= 1`` (a ``lax.cond`` skips
    it) and a bisection otherwise (``nucleus_threshold``): no sort of the vocabulary.
    """
    logits = logits_v.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)

    def greedy():
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def sampled():
        probs = jax.nn.softmax(logits / temperature, axis=-1)

        def nucleus():
            filtered = jnp.where(probs >= nucleus_threshold(probs, top_p), probs, 0.0)
            return filtered / jnp.sum(filtered, axis=-1, keepdims=True)

        return jax.lax.cond(top_p >= 1.0, lambda: probs, nucleus)

    return jax.lax.cond(temperature <= 0.0, greedy, sampled)


def sample(key: jax.Array, probs_v: jax.Array) -> jax.Array:
    """Draw from a probability vector (batched over leading axes); zero-probability tokens never."""
    logp = jnp.where(probs_v > 0, jnp.log(jnp.maximum(probs_v, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1)


def next_token(key: jax.Array, logits_v: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Greedy argmax at temperature 0, else a sample from ``target_probs``."""
    greedy_tok = jnp.argmax(logits_v, axis=-1)
    sampled = sample(key, target_probs(logits_v, temperature, top_p))
    return jnp.where(jnp.asarray(temperature) <= 0.0, greedy_tok, sampled).astype(jnp.int32)


def choose_token(key: jax.Array, logits_bv: jax.Array, temperature, top_p) -> jax.Array:
    """``next_token``, skipping the sampling path at run time when greedy (``lax.cond`` on a traced
    temperature). Both branches are ``next_token``'s own definition: results are identical."""
    return jax.lax.cond(
        temperature <= 0.0,
        lambda: jnp.argmax(logits_bv, axis=-1).astype(jnp.int32),
        lambda: next_token(key, logits_bv, temperature, top_p),
    )
