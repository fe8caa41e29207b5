"""Top-k along the last axis of an array of any rank, as one two-dimensional ``lax.top_k``.

Why: XLA:CPU (jaxlib 0.10.2) keeps a TopK of rank > 2 inside a larger program as a full, single-threaded sort
of every row (``sort(values, iota), is_stable=true``): DFlash2's train step at SmolLM2's vocabulary sorted
[4, 32, 16, 49152] twice a step (the candidates and their recomputation) and took 57 s, 14 s with this
reshape (docs/RESULTS.md, the drafters of late 2026). The same reshape is free on every other backend.

Ties: the lower index first — XLA's TopK semantics, and what the decode trees' brute-force references assume;
``tests/unit/test_top_k.py`` checks it against a stable sort on tie-heavy inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values [..., k], int32 indices [..., k]) of the ``k`` largest entries of each row of ``x`` [..., N],
    largest first, ties to the lower index."""
    x = jnp.asarray(x)
    lead = x.shape[:-1]
    vals, idx = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return vals.reshape(lead + (k,)), idx.astype(jnp.int32).reshape(lead + (k,))
