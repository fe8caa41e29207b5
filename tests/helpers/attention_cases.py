"""Cases of the tree-verification attention tests: their shapes and random inputs (shared by the
kernel's, the attention dispatch's and the kernel benchmark's tests)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from confu_jax.kernels.attention_reference import AttendTo


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 2
    t: int = 6
    hq: int = 4
    hkv: int = 2
    d: int = 16
    s: int = 40
    lens: tuple = (33, 13)  # [B] or per query ((..T..), (..T..))
    p: int = 3  # soft prompts; contemplate rows are the odd query indices
    dtype: str = "float32"
    tree: bool = False  # True: ancestor mask of a real tree; False: random mask (diagonal kept)
    tiling: tuple = (("block_k", 16), ("k_splits", 2))


CASES = [
    # Lengths not multiples of block_k=16, two cache splits, soft prompts on contemplate rows.
    Case("basic"),
    # Same shapes as "basic" (one compilation): empty cache rows; a full cache and a length-1 row.
    Case("cache_len_0", lens=(0, 0)),
    Case("full_and_len_1", lens=(40, 1)),
    Case("no_cache", s=0, lens=(0, 0)),
    Case("t1_mqa_no_prefix", t=1, hq=4, hkv=1, lens=(17, 5), p=0),
    # GQA group of 3 (SmolLM2's 9/3), the ancestor mask of a real tree over 2T=20 tokens (two tree
    # key tiles, the upper one skipped for the first row tile), four row tiles, head_dim 32, and
    # per-query cache lengths (ConFu's training form).
    Case("gqa3_tree_per_query_lengths", t=20, hq=6, hkv=2, d=32, s=48, p=4, tree=True,
         lens=((48, 3, 9, 27, 40, 0, 12, 12, 5, 39, 1, 48, 17, 30, 30, 30, 8, 8, 2, 44),
               (21,) * 20),
         tiling=(("block_k", 32), ("k_splits", 2), ("block_m", 16), ("block_kt", 16))),
    # The same rows (60 per KV head) in two row groups of two 16-row sub-tiles: each K/V tile is
    # loaded once per group and applied to both sub-tiles' states.
    Case("two_row_groups", t=20, hq=6, hkv=2, d=32, s=48, p=4, tree=True, lens=(48, 17),
         tiling=(("block_k", 16), ("k_splits", 2), ("block_m", 16), ("group_rows", 32), ("block_kt", 16))),
    Case("bf16", dtype="bfloat16", s=100, lens=(100, 61), tiling=(("block_k", 32), ("k_splits", 3))),
]


def _tree_parents(n: int) -> list:
    """A deterministic tree: node i's parent is (i-1)//2 (binary, BFS order); -1 for the root."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def ancestor_mask(parents: list) -> np.ndarray:
    """[n, n] bool: node i sees itself and its ancestors (the tree-verification mask)."""
    n = len(parents)
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def make_inputs(c: Case, seed: int = 0):
    """Random inputs from numpy (no per-shape XLA compilations for the RNG)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(c.dtype)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)  # noqa: E731
    q = normal(c.b, c.t, c.hq, c.d)
    kb, vb = normal(c.b, c.t, c.hkv, c.d), normal(c.b, c.t, c.hkv, c.d)
    if c.tree:
        mask = np.broadcast_to(ancestor_mask(_tree_parents(c.t)), (c.b, c.t, c.t))
    else:
        mask = (rng.random((c.b, c.t, c.t)) < 0.4) | np.eye(c.t, dtype=bool)
    kc, vc = (normal(c.b, c.hkv, c.s, c.d), normal(c.b, c.hkv, c.s, c.d)) if c.s else (None, None)
    lens = jnp.asarray(c.lens, jnp.int32) if c.s else None
    kp, vp = (normal(c.p, c.hkv, c.d), normal(c.p, c.hkv, c.d)) if c.p else (None, None)
    pvis = jnp.asarray(np.broadcast_to(np.arange(c.t) % 2 == 1, (c.b, c.t))) if c.p else None
    return (q, kb, vb, AttendTo(mask=jnp.asarray(mask), k_cache=kc, v_cache=vc, cache_len=lens, k_prefix=kp, v_prefix=vp,
                                prefix_visible=pvis))


# Tests compile many small programs and run them once: skip LLVM's optimisation passes.
