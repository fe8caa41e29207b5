"""Top-k along the last axis of an array of any rank, as one two-dimensional ``lax.top_k`` on every platform.

Why: a TopK of rank > 2 can become a full sort of every row on two of the three compilers, while a
two-dimensional one is each compiler's own TopK (jaxlib 0.10.2, libtpu 0.0.42, the CUDA 12 plugin; docs/RESULTS.md,
"Top-k on the hardware's compilers"):

* XLA:CPU keeps a rank > 2 TopK inside a larger program as a full, single-threaded ``sort(values, iota)``:
  DFlash2's train step at SmolLM2's vocabulary sorted [4, 32, 16, 49152] twice a step and took 57 s, 14 s
  with this reshape.
* XLA:TPU lowers a rank > 2 TopK to the same full sort over the vocabulary (two input-sized temporaries, the
  values and the sorted iota) and a two-dimensional one to its ``TopK`` custom call (one input-sized
  transposed copy): per v5e chip 1,002 MiB of temporaries against 501. In DFlash2's Llama-3.1-8B step on v5e-8
  the flattened form is what fits a chip (rows of 1,280 at batch 8: 15.69 GiB; 1,024: 15.25, 16.82 sorted);
  at rows of 4,096, which fit neither way, XLA's schedule came out 1.8 GiB higher with it.
* XLA:GPU gives both forms its ``TopK`` custom call: the reshape is free there.

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
    if x.ndim <= 2:
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    lead = x.shape[:-1]
    vals, idx = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return vals.reshape(lead + (k,)), idx.astype(jnp.int32).reshape(lead + (k,))
