"""Logit processing shared by autoregressive and speculative decoding.

Speculative sampling is lossless only if the verifier's target distribution is exactly the one AR
decoding samples from; both paths therefore call ``target_probs`` and nothing else.
Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_probs(logits_v: jax.Array, temperature, top_p=1.0) -> jax.Array:
    """Probabilities over the last axis after temperature and nucleus (top-p) filtering.

    ``temperature`` and ``top_p`` may be traced scalars (one compiled loop serves all settings).
    Top-p keeps the smallest set of most-probable tokens whose mass reaches ``top_p`` (the token
    that crosses the threshold is kept), as Hugging Face's ``TopPLogitsWarper``; ties at the
    boundary are kept together.
    """
    logits = logits_v.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature)
    probs = jax.nn.softmax(logits / safe_t, axis=-1)
    # nucleus: a token survives if the mass strictly above it is < top_p
    sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
    cum_above = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = cum_above < jnp.asarray(top_p, jnp.float32)
    # smallest kept probability is the threshold
    thresh = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1, keepdims=True)
    filtered = jnp.where(probs >= thresh, probs, 0.0)
    filtered = filtered / jnp.sum(filtered, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, onehot, filtered)


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
