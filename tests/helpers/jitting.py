"""``jit_static``: run a library function under ``jax.jit`` in a test, with every argument that is
not an array tree (configs, specs, ints, strings) static.

Why: a test that calls model pieces outside jit (a reference forward, a hand computation, a drafter
stepped by hand) makes XLA:CPU compile every primitive on its own — hundreds of ~40 ms compiles a
test on 2 cores. Under jit the same function is one program; the arithmetic is the same, so a test's
assertions (equality with torch, with a hand computation) keep their meaning.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def _is_array_tree(x) -> bool:
    """Every leaf an array (an empty tree or None counts: jit passes them through)."""
    return all(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in jax.tree_util.tree_leaves(x))


def jit_static(fn):
    """``fn`` under ``jax.jit``; positional and keyword arguments that are not array trees are static
    (they must be hashable: frozen dataclasses, tuples, numbers, strings)."""
    compiled = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        static = tuple(i for i, a in enumerate(args) if not _is_array_tree(a))
        names = tuple(sorted(k for k, v in kwargs.items() if not _is_array_tree(v)))
        key = (static, names)
        if key not in compiled:
            compiled[key] = jax.jit(fn, static_argnums=static, static_argnames=names)
        return compiled[key](*args, **kwargs)

    return call
