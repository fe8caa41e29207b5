"""Top-k along the last axis of an array of any rank; compiled for a CPU, as one two-dimensional ``lax.top_k``.

Why: XLA:CPU (jaxlib 0.10.2) keeps a TopK of rank > 2 inside a larger program as a full, single-threaded sort
of every row (``sort(values, iota), is_stable=true``): DFlash2's train step at SmolLM2's vocabulary sorted
[4, 32, 16, 49152] twice a step (the candidates and their recomputation) and took 57 s, 14 s with this
reshape (docs/RESULTS.md, the drafters of late 2026). It is not free elsewhere: XLA:TPU held the flattened
candidates as a copy, and DFlash2's Llama-3.1-8B step on v5e-8 (rows of 4096, batch 8) went from 17.55 to 19.34 GiB
a chip. So the reshape is taken only when compiling for a CPU (``devices.compile_platform``: the platform compiled
for, not the host's); every other platform gets ``lax.top_k`` as is (the same values and indices). Not settled for
XLA:TPU: at rows of 1,024 the same step needs 16.82 GiB with the rank-4 top-k and 15.25 flattened (the only one
that fits a v5e chip), so the better form depends on the shape (docs/RESULTS.md, DFlash2's v5e-8 rerun).

Ties: the lower index first — XLA's TopK semantics, and what the decode trees' brute-force references assume;
``tests/unit/test_top_k.py`` checks it against a stable sort on tie-heavy inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values [..., k], int32 indices [..., k]) of the ``k`` largest entries of each row of ``x`` [..., N],
    largest first, ties to the lower index."""
    from confu_jax.devices import compile_platform

    x = jnp.asarray(x)
    if x.ndim <= 2 or compile_platform() != "cpu":
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    lead = x.shape[:-1]
    vals, idx = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return vals.reshape(lead + (k,)), idx.astype(jnp.int32).reshape(lead + (k,))
