"""Pallas kernel for ConFu tree-verification attention (GPU), plus its jnp reference.

One verification pass scores 2T queries per row (T tree nodes, one contemplate token after each)
against three key blocks: the committed cache (thousands of slots, a valid length per row), the
soft prompts (a handful of keys, visible to contemplate rows only) and the 2T tree tokens
themselves under the tree mask. The cache dominates the bytes, so the kernel is a flash-decoding
(split-K) kernel over the cache in which one program owns *all* queries of a row that share one KV
head — rows ``r = t * G + g`` (tree position t, head g of the GQA group), G·2T of them: 240 at
T = 30 and 480 at T = 60 for Llama-3.1-8B (G = 4).

Grid ``(J, B * Hkv)``: ``J = k_splits + 1`` column programs per (batch row, KV head), the first
``k_splits`` each owning a contiguous range of cache slots and the last one owning the soft prompts
and the tree block. Inside a program the rows form ``n_groups`` row groups of ``n_sub`` sub-tiles of
``block_m`` (<= 128) rows; every K/V tile is **loaded once per row group** and applied to each
sub-tile's online-softmax state ``(o, m, l)`` (float32). By default a group is **one** sub-tile
(:func:`default_tiling`): ptxas (sm_90a, ``launch.kernel_bench --registers``) found that Triton keeps
every sub-tile's state and query tile live through the key loop, so two or more sub-tiles spilled
at every shape tried (255 registers and 120–928 bytes of spill stores at 60–120 queries, Llama-3.1-8B
and SmolLM2 heads, 4 to 16 warps), while one sub-tile of 128 rows at 8 warps needs 128–231 registers
and spills nothing. So at T = 30 (240 rows for Llama-3.1-8B) the program's second group reloads its
key range right after the first finished with it — an L2 hit unless evicted — the price of keeping
the states in registers; ``group_rows`` still takes larger groups for experiments.
``launch.kernel_bench`` prints what this reads and writes (its bytes model counts the
cache once, the L2 reloads apart, the queries read by each program, the partials and the epilogue).
Every program writes its normalised output (input dtype) with its log-sum-exp; a small jnp epilogue
merges the J partials by softmax mass (flash-decoding's final reduction). Skipping:

* cache tiles at or past ``max(len)`` of the row group are never loaded (the loop bound is
  dynamic), so a split beyond every row's length costs one empty program and a cache of length 0
  costs nothing;
* the soft-prompt block is skipped for a sub-tile with no contemplate row;
* a tree key tile is skipped for a sub-tile whose mask is all-false on it (padding rows, early
  nodes against later keys).

Verification only: blocks of at most :data:`MAX_QUERIES` queries per row (the tree tiles are a
static loop). Prefill (longer blocks) takes the blockwise XLA path (``models.attention``).

Lengths are per query row (``cache_len_bt`` [B, T] or [B]), which covers both verification (all
queries of a row see the same length) and ConFu's training form (per-query lengths); there is no
fallback to the reference. Rows that see no key return zeros, as the reference does.

Backend choice (JAX 0.10.2, the version pinned here): **Triton lowering**, selected explicitly
with ``compiler_params=pallas.triton.CompilerParams``.

* In 0.10.2 a ``pallas_call`` without compiler params lowers to Mosaic GPU
  (``jax_pallas_use_mosaic_gpu`` is on), but JAX already warns that ``pallas_call`` for Mosaic GPU
  is deprecated in favour of ``plgpu.kernel`` (warp-group programming with TMA/WGMMA), and that
  API's interpreter is private and partial in 0.10.2. A Mosaic GPU kernel could therefore not be
  checked numerically on a CPU-only CI, which is the one place this project can check it.
* The Triton backend's block-level model fits this kernel: ragged per-row lengths become masked
  loads and dynamic loop bounds, the query tile is small (2T·G rows) and its dots need only
  16-wide tiles. JAX's own split-K GQA decode kernel (``jax.experimental.pallas.ops.gpu.
  decode_attention``) is written the same way.
* The same kernel body runs under Pallas' generic interpreter (``interpret=True``) on CPU for the
  numeric tests, and its CUDA lowering (jaxpr → Triton IR, compute capability 9.0 = H100 when no
  GPU is attached) runs at JAX lowering time, so CPU CI catches lowering breakage too.
* The Pallas changelog ("Released with JAX 0.11.0", July 2026) deprecates the Triton backend for
  later removal. The kernel runs on 0.11 (Python 3.12, ``requirements-jax011.txt``; lowering it
  warns with a DeprecationWarning, and lowering without a GPU needs :func:`cuda_target`). The port to
  ``plgpu.kernel`` (template: ``ops/gpu/attention_mgpu.py``) belongs with that upgrade;
  :func:`masked_attention_reference` and ``tests/unit/test_tree_attention.py`` are the spec it must meet.

Inference only: there is no VJP (training runs the XLA path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from confu_jax.kernels.attention_reference import NEG_INF, AttendTo, masked_attention_reference

__all__ = [
    "masked_attention_pallas",
    "tree_attention_reference",
    "dense_masked_attention",
    "default_tiling",
    "kernel_plan",
    "KernelPlan",
    "MAX_QUERIES",
    "resolve_attention_impl",
    "cuda_target",
]

# The jnp reference with the kernel's signature (the "jnp reference"): it is the XLA path
# every other caller uses, so kernel and XLA path are compared against one definition.
tree_attention_reference = masked_attention_reference

_MIN_TILE = 16  # Triton dots need every dimension >= 16, and tiles must be powers of two.


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the local GPU (H100 SXM: 132; also when lowering on CPU)."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return default


# Longest block (queries per row) the kernel takes: verification (2T <= 120 at the paper's
# budgets). Longer blocks are prefill and go to the blockwise XLA path (models/attention.py).
MAX_QUERIES = 256


def default_tiling(n_rows: int, cache_len_max: int, head_dim: int, n_programs_per_split: int = 1,
                   n_sms: Optional[int] = None) -> dict:
    """Tile sizes for an H100 (reasoned, not yet tuned on hardware; the benchmark sweeps them).

    ``n_rows`` = G x T query rows per KV head. ``block_m`` (<= 128) is the row sub-tile of one dot;
    ``group_rows`` (a multiple of it) the rows whose states share each loaded K/V tile: one sub-tile,
    the most whose state stays in registers (module docstring; ``tests/compile`` checks ptxas' spill
    count at the shipped plans). 8 warps for a 128-row tile (at 4 its state spills), else 4; key
    tiles of 64 slots.
    ``k_splits`` aims at ~2 waves of programs over the SMs (``n_programs_per_split`` = B x Hkv),
    capped so the partials the splits write (each ``m_pad x head_dim``) stay at most ~1/4 of the K/V
    they read.
    """
    block_m = min(128, max(_MIN_TILE, _next_pow2(n_rows)))
    m_pad = -(-n_rows // block_m) * block_m
    group_rows = block_m
    block_k = 64  # 128 spilled in float32 at head_dim 64 (SmolLM2: 255 registers, 4-8 B of spill stores)
    if cache_len_max > 0:
        want = -(-2 * (n_sms or _num_sms()) // max(1, n_programs_per_split))
        cap = cache_len_max // (2 * max(m_pad, 256))
        k_splits = max(1, min(want, cap, 32))
    else:
        k_splits = 0
    return dict(block_m=block_m, group_rows=group_rows, block_k=block_k, k_splits=k_splits,
                num_warps=8 if block_m >= 128 else 4, num_stages=2)


# ----------------------------------------------------------------------------- kernel


def _online_update(carry, s_mk, visible_mk, v_kd):
    """One flash-attention step over a key tile; masked entries contribute exactly zero."""
    o_md, m_m, l_m = carry
    s_mk = jnp.where(visible_mk, s_mk, NEG_INF)
    m_new = jnp.maximum(m_m, jnp.max(s_mk, axis=1))
    alpha = jnp.exp(m_m - m_new)
    p_mk = jnp.where(visible_mk, jnp.exp(s_mk - m_new[:, None]), 0.0)
    l_new = alpha * l_m + jnp.sum(p_mk, axis=1)
    pv_md = jnp.dot(p_mk.astype(v_kd.dtype), v_kd, preferred_element_type=jnp.float32)
    return alpha[:, None] * o_md + pv_md, m_new, l_new


def _scores(q_md, k_kd, scale):
    """q @ k^T in float32 (IEEE for float32 inputs, tensor cores for bf16)."""
    s = lax.dot_general(q_md, k_kd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s * scale


def _tree_attention_kernel(*refs, has_cache: bool, has_prefix: bool, k_splits: int,
                           split_len: int, block_k: int, block_kt: int, n_tree_tiles: int,
                           prefix_len: int, prefix_pad: int, scale: float, block_m: int,
                           n_sub: int, n_groups: int, count_tiles: bool = False):
    """One program = one (column block j, batch row, KV head), *all* its query rows.

    The rows are ``n_groups`` groups of ``n_sub`` sub-tiles of ``block_m`` rows. Within a group
    every K/V tile is loaded once and applied to each sub-tile's online-softmax state (the states
    of a group are what stays on chip: ``n_sub * block_m * head_dim`` float32). A second group
    reloads the program's key range right after the first finished with it (L2-resident)."""
    refs = list(refs)
    q_ref, kb_ref, vb_ref, mask_ref = refs[:4]
    rest = refs[4:]
    if has_cache:
        lens_ref, kc_ref, vc_ref, *rest = rest
    if has_prefix:
        pvis_ref, kp_ref, vp_ref, *rest = rest
    o_ref, lse_ref, *tiles_ref = rest  # tiles_ref: [cache tiles, tree tiles] loaded (count_tiles)
    cache_loads = tree_loads = jnp.int32(0)

    j = pl.program_id(0)
    head_dim = q_ref.shape[-1]

    def fresh():
        return (jnp.zeros((block_m, head_dim), jnp.float32),
                jnp.full((block_m,), NEG_INF, jnp.float32),
                jnp.zeros((block_m,), jnp.float32))

    for grp in range(n_groups):  # static
        rows = [pl.ds((grp * n_sub + i) * block_m, block_m) for i in range(n_sub)]
        q_s = [q_ref[r, :] for r in rows]
        init = tuple(fresh() for _ in rows)

        def cache_part(rows=rows, q_s=q_s, init=init):
            lens_s = [lens_ref[r] for r in rows]
            max_len = functools.reduce(jnp.maximum, [jnp.max(x) for x in lens_s])
            start = j * split_len
            hi = jnp.minimum(start + split_len, max_len)
            n_tiles = jnp.maximum(hi - start + block_k - 1, 0) // block_k

            def body(it, carry):
                k0 = start + it * block_k
                cols_k = k0 + jnp.arange(block_k, dtype=jnp.int32)
                load_kd = jnp.broadcast_to((cols_k < hi)[:, None], (block_k, head_dim))
                # the tile is loaded once and serves every sub-tile of the group
                k_kd = pltriton.load(kc_ref.at[pl.ds(k0, block_k), :], mask=load_kd, other=0.0)
                v_kd = pltriton.load(vc_ref.at[pl.ds(k0, block_k), :], mask=load_kd, other=0.0)
                states, loads = carry
                return tuple(_online_update(c, _scores(q, k_kd, scale), cols_k[None, :] < ln[:, None], v_kd)
                             for c, q, ln in zip(states, q_s, lens_s)), loads + 1

            return (*lax.fori_loop(0, n_tiles, body, (init, jnp.int32(0))), jnp.int32(0))

        def extra_part(rows=rows, q_s=q_s, init=init):
            carry = list(init)
            if has_prefix:
                kp, vp = kp_ref[...], vp_ref[...]
                cols_p = jnp.arange(prefix_pad, dtype=jnp.int32)
                for i, r in enumerate(rows):
                    pvis_m = pvis_ref[r]
                    visible = (pvis_m[:, None] > 0) & (cols_p[None, :] < prefix_len)

                    def with_prefix(c, q=q_s[i], visible=visible):
                        return _online_update(c, _scores(q, kp, scale), visible, vp)

                    carry[i] = lax.cond(jnp.max(pvis_m) > 0, with_prefix, lambda c: c, carry[i])
            for kt in range(n_tree_tiles):  # static: the kernel takes at most MAX_QUERIES tokens
                tile = pl.ds(kt * block_kt, block_kt)
                kb, vb = kb_ref[tile, :], vb_ref[tile, :]  # loaded once for the group's sub-tiles
                for i, r in enumerate(rows):
                    mask_mk = mask_ref[r, tile].astype(jnp.int32)

                    def with_tile(c, q=q_s[i], mask_mk=mask_mk, kb=kb, vb=vb):
                        return _online_update(c, _scores(q, kb, scale), mask_mk > 0, vb)

                    carry[i] = lax.cond(jnp.max(mask_mk) > 0, with_tile, lambda c: c, carry[i])
            return tuple(carry), jnp.int32(0), jnp.int32(n_tree_tiles)

        if has_cache:
            states, n_cache, n_tree = lax.cond(j < k_splits, cache_part, extra_part)
        else:
            states, n_cache, n_tree = extra_part()
        cache_loads, tree_loads = cache_loads + n_cache, tree_loads + n_tree
        # Normalised partial in the input dtype (half the bytes of a float32 partial for bf16) and
        # its log-sum-exp; rows that saw no key write zeros and NEG_INF.
        for r, (o_md, m_m, l_m) in zip(rows, states):
            l_safe = jnp.where(l_m > 0, l_m, 1.0)
            o_ref[r, :] = (o_md / l_safe[:, None]).astype(o_ref.dtype)
            lse_ref[r] = jnp.where(l_m > 0, m_m + jnp.log(l_safe), NEG_INF)
    if count_tiles:
        tiles_ref[0][...] = jnp.stack([cache_loads, tree_loads])


# ----------------------------------------------------------------------------- lowering without a GPU

H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def cuda_target(device_kind: str = H100_DEVICE_KIND, num_cores: int = 132):
    """Lower the kernel for a CUDA GPU on a machine without one:
    ``with cuda_target(): jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))``.

    JAX 0.10 lowered Pallas' Triton kernels for compute capability 9.0 when no GPU was attached;
    JAX 0.11 asks which GPU to compile for ("No supported GPU devices found, please specify an
    abstract GPU device") through an abstract mesh carrying an abstract device. This sets one
    (one device, the training mesh's axis names) on both versions."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    # Auto axes: the lowered program is the one a plain jit gives (Explicit axes would turn on
    # sharding-in-types checks for every op of the traced function).
    mesh = AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                        abstract_device=device)
    with use_abstract_mesh(mesh):
        yield mesh


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How one call is tiled (``kernel_plan``): what the wrapper launches and what
    ``launch.kernel_bench``'s bytes model counts."""

    n_rows: int  # G x T query rows per (batch row, KV head)
    block_m: int  # rows per dot (sub-tile)
    group_rows: int  # rows sharing each loaded K/V tile (n_sub sub-tiles)
    m_pad: int  # n_groups x group_rows >= n_rows
    n_groups: int
    n_sub: int
    block_k: int  # cache slots per loaded tile
    k_splits: int  # cache programs per (batch row, KV head); one more program takes prompts + tree
    split_len: int  # cache slots per split (a multiple of block_k)
    t_pad: int  # the block's keys, padded to a power of two
    block_kt: int  # tree keys per loaded tile
    p_len: int
    p_pad: int

    @property
    def n_programs_per_head(self) -> int:
        return self.k_splits + 1


def kernel_plan(b: int, t: int, hq: int, hkv: int, d: int, s_len: int, *, has_prefix: bool = False,
                p_len: int = 0, block_m: Optional[int] = None, group_rows: Optional[int] = None,
                block_k: Optional[int] = None, k_splits: Optional[int] = None,
                block_kt: Optional[int] = None) -> KernelPlan:
    """Resolve the tiling of one call (arguments left None take :func:`default_tiling`'s)."""
    if t > MAX_QUERIES:
        raise ValueError(f"the Pallas kernel verifies blocks of at most {MAX_QUERIES} queries per row, got {t}: "
                         "longer blocks are prefill, which models.attention.masked_attention sends to the "
                         "blockwise XLA path")
    g = hq // hkv
    n_rows = t * g
    tiling = default_tiling(n_rows, s_len, d, b * hkv)
    block_m = block_m or tiling["block_m"]
    group_rows = group_rows or max(block_m, tiling["group_rows"] // block_m * block_m)
    block_k = block_k or tiling["block_k"]
    k_splits = (k_splits or tiling["k_splits"]) if s_len > 0 else 0
    for name, v in (("block_m", block_m), ("block_k", block_k), ("block_kt", block_kt or 64)):
        if v < _MIN_TILE or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {_MIN_TILE}, got {v}")
    if group_rows % block_m:
        raise ValueError(f"group_rows must be a multiple of block_m={block_m}, got {group_rows}")
    group_rows = min(group_rows, -(-n_rows // block_m) * block_m)
    m_pad = -(-n_rows // group_rows) * group_rows
    t_pad = max(_MIN_TILE, _next_pow2(t))
    split_len = 0
    if s_len > 0:
        split_len = -(-s_len // k_splits)
        split_len = -(-split_len // block_k) * block_k
        k_splits = -(-s_len // split_len)
    return KernelPlan(n_rows=n_rows, block_m=block_m, group_rows=group_rows, m_pad=m_pad,
                      n_groups=m_pad // group_rows, n_sub=group_rows // block_m, block_k=block_k,
                      k_splits=k_splits, split_len=split_len, t_pad=t_pad, block_kt=min(t_pad, block_kt or 64),
                      p_len=p_len if has_prefix else 0,
                      p_pad=max(_MIN_TILE, _next_pow2(p_len)) if has_prefix and p_len else 0)


# ----------------------------------------------------------------------------- wrapper


def _rows(x_bt, g: int, m_pad: int, fill=0):
    """[B, T, ...] per-query values -> [B, M_pad, ...] per kernel row r = t*G + g."""
    x = jnp.repeat(x_bt, g, axis=1)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, m_pad - x.shape[1])
    return jnp.pad(x, pad, constant_values=fill)


def masked_attention_pallas(
    q_bthd: jax.Array,
    k_blk_bthd: jax.Array,
    v_blk_bthd: jax.Array,
    to: AttendTo,
    *,
    interpret: bool = False,
    block_m: Optional[int] = None,
    group_rows: Optional[int] = None,
    block_k: Optional[int] = None,
    k_splits: Optional[int] = None,
    block_kt: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    count_tiles: bool = False,
):
    """Same contract as :func:`masked_attention_reference`, computed by the Pallas kernel.

    ``interpret=True`` runs the kernel body with Pallas' interpreter (CPU tests); otherwise it
    lowers through Triton for CUDA. Tiling arguments default to :func:`default_tiling`;
    ``block_kt`` is the key tile over the 2T tree tokens (default 64, capped at padded 2T).
    ``count_tiles=True`` (interpret mode, for tests of ``launch.kernel_bench``'s bytes model) also
    returns an int32 [B, Hkv, J, 2] array: the cache and tree K/V tiles each program loaded.
    ``to.cache_start`` (packed training rows) is not supported: the dispatch refuses it.
    """
    if to.cache_start is not None:
        raise ValueError("the Pallas kernel has no cache_start (a lower bound on visible cache slots, used by "
                         "packed training rows)")
    block_mask_btt, k_cache_bhsd, v_cache_bhsd, cache_len_bt = to.mask, to.k_cache, to.v_cache, to.cache_len
    k_prefix_phd, v_prefix_phd, prefix_visible_bt = to.k_prefix, to.v_prefix, to.prefix_visible
    b, t, hq, d = q_bthd.shape
    hkv = k_blk_bthd.shape[2]
    _check_block_shapes(q_bthd, k_blk_bthd, v_blk_bthd, block_mask_btt)
    g = hq // hkv
    dtype = q_bthd.dtype
    has_cache = k_cache_bhsd is not None and k_cache_bhsd.shape[2] > 0
    has_prefix = k_prefix_phd is not None and k_prefix_phd.shape[0] > 0
    s_len = k_cache_bhsd.shape[2] if has_cache else 0

    pl_ = kernel_plan(b, t, hq, hkv, d, s_len, has_prefix=has_prefix,
                      p_len=k_prefix_phd.shape[0] if has_prefix else 0, block_m=block_m,
                      group_rows=group_rows, block_k=block_k, k_splits=k_splits, block_kt=block_kt)
    n_rows, m_pad, t_pad = pl_.n_rows, pl_.m_pad, pl_.t_pad
    block_k, k_splits, split_len, block_kt = pl_.block_k, pl_.k_splits, pl_.split_len, pl_.block_kt
    tiling = default_tiling(n_rows, s_len, d, b * hkv)

    # Query rows r = t*G + g for each KV head: [B, Hkv, M_pad, D]. q is tiny next to the cache.
    q_bkmd = q_bthd.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d)
    q_bkmd = jnp.pad(q_bkmd, ((0, 0), (0, 0), (0, m_pad - n_rows), (0, 0)))
    mask_bmt = _rows(block_mask_btt.astype(jnp.int8), g, m_pad)
    mask_bmt = jnp.pad(mask_bmt, ((0, 0), (0, 0), (0, t_pad - t)))
    tree_pad = ((0, 0), (0, t_pad - t), (0, 0), (0, 0))
    kb = jnp.pad(k_blk_bthd.astype(dtype), tree_pad)
    vb = jnp.pad(v_blk_bthd.astype(dtype), tree_pad)

    # Grid (J, B * Hkv): program (j, bh) owns column block j (a cache split, or the soft prompts +
    # tree block for j = k_splits) for every query row of batch row b = bh // Hkv, KV head bh % Hkv.
    def q_map(j, bh):
        return (bh // hkv, bh % hkv, 0, 0)
    def tree_kv_map(j, bh):
        return (bh // hkv, 0, bh % hkv, 0)
    def cache_map(j, bh):  # the cache is head-major [B, Hkv, S, D]
        return (bh // hkv, bh % hkv, 0, 0)
    def row_map(j, bh):
        return (bh // hkv, 0)

    args = [q_bkmd, kb, vb, mask_bmt]
    in_specs = [
        pl.BlockSpec((None, None, m_pad, d), q_map),
        pl.BlockSpec((None, t_pad, None, d), tree_kv_map),
        pl.BlockSpec((None, t_pad, None, d), tree_kv_map),
        pl.BlockSpec((None, m_pad, t_pad), lambda j, bh: (bh // hkv, 0, 0)),
    ]
    if has_cache:
        if cache_len_bt is None:
            raise ValueError("cache_len_bt is required when a cache is given")
        lens = jnp.asarray(cache_len_bt, jnp.int32)
        if lens.ndim == 1:
            lens = jnp.broadcast_to(lens[:, None], (b, t))
        if lens.shape != (b, t):
            raise ValueError(f"cache_len_bt must be [B] or [B,T]={(b, t)}, got {lens.shape}")
        lens = jnp.clip(lens, 0, s_len)
        # The cache is passed whole and unpadded (no copy): tail tiles are masked loads.
        args += [_rows(lens, g, m_pad), k_cache_bhsd.astype(dtype), v_cache_bhsd.astype(dtype)]
        in_specs += [
            pl.BlockSpec((None, m_pad), row_map),
            pl.BlockSpec((None, None, s_len, d), cache_map),
            pl.BlockSpec((None, None, s_len, d), cache_map),
        ]
    p_len, p_pad = pl_.p_len, pl_.p_pad
    if has_prefix:
        if prefix_visible_bt is None:
            raise ValueError("prefix_visible_bt is required when prefix K/V are given")
        ppad = ((0, p_pad - p_len), (0, 0), (0, 0))
        args += [_rows(prefix_visible_bt.astype(jnp.int32), g, m_pad),
                 jnp.pad(k_prefix_phd.astype(dtype), ppad), jnp.pad(v_prefix_phd.astype(dtype), ppad)]
        in_specs += [
            pl.BlockSpec((None, m_pad), row_map),
            pl.BlockSpec((p_pad, None, d), lambda j, bh: (0, bh % hkv, 0)),
            pl.BlockSpec((p_pad, None, d), lambda j, bh: (0, bh % hkv, 0)),
        ]

    n_j = k_splits + 1
    kernel = functools.partial(
        _tree_attention_kernel, has_cache=has_cache, has_prefix=has_prefix, k_splits=k_splits,
        split_len=split_len, block_k=block_k, block_kt=block_kt, n_tree_tiles=t_pad // block_kt,
        prefix_len=p_len, prefix_pad=p_pad, scale=1.0 / math.sqrt(d), block_m=pl_.block_m, n_sub=pl_.n_sub,
        n_groups=pl_.n_groups, count_tiles=count_tiles)
    part_map = lambda j, bh: (bh // hkv, bh % hkv, j, 0, 0)  # noqa: E731
    stat_map = lambda j, bh: (bh // hkv, bh % hkv, j, 0)  # noqa: E731
    if count_tiles and not interpret:
        raise ValueError("count_tiles is a test instrument of the interpreted kernel (interpret=True)")
    out_specs = [pl.BlockSpec((None, None, None, m_pad, d), part_map),
                 pl.BlockSpec((None, None, None, m_pad), stat_map)]
    out_shape = [jax.ShapeDtypeStruct((b, hkv, n_j, m_pad, d), dtype),
                 jax.ShapeDtypeStruct((b, hkv, n_j, m_pad), jnp.float32)]
    if count_tiles:
        out_specs.append(pl.BlockSpec((None, None, None, 2), lambda j, bh: (bh // hkv, bh % hkv, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, n_j, 2), jnp.int32))
    o_part, lse_part, *tiles = pl.pallas_call(
        kernel,
        grid=(n_j, b * hkv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or tiling["num_warps"],
            num_stages=num_stages or tiling["num_stages"]),
        interpret=interpret,
        name="confu_tree_attention",
    )(*args)

    o = _merge_splits(o_part, lse_part)[:, :, :n_rows]  # [B,Hkv,T*G,D]
    o = o.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    o = o.reshape(b, t, hq, d).astype(dtype)
    # count_tiles: also [B, Hkv, J, 2] int32, the (cache, tree) K/V tiles each program loaded
    return (o, tiles[0]) if count_tiles else o


def _check_block_shapes(q_bthd, k_blk_bthd, v_blk_bthd, block_mask_btt) -> None:
    b, t, hq, d = q_bthd.shape
    hkv = k_blk_bthd.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if d < _MIN_TILE or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= {_MIN_TILE} for the Pallas kernel, got {d}")
    if k_blk_bthd.shape != (b, t, hkv, d) or v_blk_bthd.shape != (b, t, hkv, d):
        raise ValueError(f"block K/V must be [B,T,Hkv,D]={(b, t, hkv, d)}, got "
                         f"{k_blk_bthd.shape} and {v_blk_bthd.shape}")
    if block_mask_btt.shape != (b, t, t):
        raise ValueError(f"block_mask_btt must be [B,T,T]={(b, t, t)}, got {block_mask_btt.shape}")


def _merge_splits(o_part, lse_part):
    """Flash-decoding epilogue: weight each split's normalised output [B,Hkv,J,M,D] by its share of
    the softmax mass, exp(lse_j - lse*) / sum_j exp(lse_j - lse*) -> [B,Hkv,M,D] float32."""
    lse_star = jnp.max(lse_part, axis=2, keepdims=True)
    w = jnp.where(lse_part > NEG_INF / 2, jnp.exp(lse_part - lse_star), 0.0)  # [B,Hkv,J,M]
    den = jnp.sum(w, axis=2)
    o = jnp.sum(w[..., None] * o_part.astype(jnp.float32), axis=2)  # elementwise: no TF32
    return o / jnp.where(den == 0, 1.0, den)[..., None]


# ----------------------------------------------------------------------------- dense baseline


def dense_masked_attention(q_bthd, k_blk_bthd, v_blk_bthd, to: AttendTo) -> jax.Array:
    """The naive baseline: ``jax.nn.dot_product_attention`` over [cache | prefix | tree] keys
    concatenated, with one dense [B, 2T, S+P+2T] boolean mask.

    What a framework without structured attention does (copy the cache next to the tree, build
    the full mask, attend densely); the benchmark's lower bar, and an independent (JAX-written)
    check of the semantics. Unlike the reference, a query that sees no key at all gets JAX's
    behaviour (a uniform average), so compare only rows that see at least one key.
    """
    block_mask_btt, k_cache_bhsd, v_cache_bhsd, cache_len_bt = to.mask, to.k_cache, to.v_cache, to.cache_len
    k_prefix_phd, v_prefix_phd, prefix_visible_bt = to.k_prefix, to.v_prefix, to.prefix_visible
    b, t, _, _ = q_bthd.shape
    ks, vs, masks = [], [], []
    if k_cache_bhsd is not None and k_cache_bhsd.shape[2] > 0:
        s_len = k_cache_bhsd.shape[2]
        lens = jnp.asarray(cache_len_bt, jnp.int32)
        lens = jnp.broadcast_to(lens[:, None], (b, t)) if lens.ndim == 1 else lens
        ks.append(jnp.swapaxes(k_cache_bhsd, 1, 2))
        vs.append(jnp.swapaxes(v_cache_bhsd, 1, 2))
        masks.append(jnp.arange(s_len)[None, None, :] < lens[:, :, None])
    if k_prefix_phd is not None and k_prefix_phd.shape[0] > 0:
        p_len = k_prefix_phd.shape[0]
        ks.append(jnp.broadcast_to(k_prefix_phd[None], (b,) + k_prefix_phd.shape))
        vs.append(jnp.broadcast_to(v_prefix_phd[None], (b,) + v_prefix_phd.shape))
        masks.append(jnp.broadcast_to(prefix_visible_bt[:, :, None], (b, t, p_len)))
    ks.append(k_blk_bthd)
    vs.append(v_blk_bthd)
    masks.append(block_mask_btt)
    k = jnp.concatenate([x.astype(q_bthd.dtype) for x in ks], axis=1)
    v = jnp.concatenate([x.astype(q_bthd.dtype) for x in vs], axis=1)
    mask_b1ts = jnp.concatenate(masks, axis=-1)[:, None]
    return jax.nn.dot_product_attention(q_bthd, k, v, mask=mask_b1ts, implementation="xla")


# ----------------------------------------------------------------------------- selection

ATTENTION_IMPLS = ("xla", "pallas", "pallas_interpret")


def resolve_attention_impl(impl: str, backend: Optional[str] = None) -> str:
    """Validate a config's ``attention_impl`` against the backend it will run on.

    'pallas' compiles only for CUDA GPUs (this kernel's Triton lowering); on CPU the kernel runs
    only interpreted, which is for tests, so asking for 'pallas' there is an error rather than a
    silent 100x slowdown. ``backend`` defaults to the platform compiled for
    (``devices.compile_platform``), not the host's.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if not backend:
        from confu_jax.devices import compile_platform

        backend = compile_platform()
    if impl == "pallas" and backend != "gpu":
        raise ValueError(
            f"attention_impl='pallas' needs a CUDA GPU (the Triton-lowered tree-attention "
            f"kernel); the backend is {backend!r}. Use 'xla' (the CPU default) or "
            f"'pallas_interpret' (the kernel under Pallas' interpreter, for tests).")
    return impl
