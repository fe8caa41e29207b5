"""Fused kernels behind ``kernels.flash_attention``'s contract, for the accelerators: JAX's Pallas flash
attention on GPU (Triton) and splash attention on TPU (Mosaic), each also runnable under Pallas'
interpreter on CPU, which is how the suite checks them against the XLA form.

The contract is the training forwards' causal attention of a row to itself (``CausalSegments``: key j
visible to query i iff j <= i and, in a packed row, both carry the same segment id), queries [B,T,Hq,D]
over keys / values [B,T,Hkv,D], softmax scale 1/sqrt(D), output in q's dtype — what
``flash_attention(q, k, v, segment_ids_bt=...)`` computes in XLA with its online softmax. The fused
kernels compute the same thing in one kernel per (row, head, query block), without XLA's block loop;
both are differentiable (their own backward kernels), so the same choice serves forwards whose
gradients are taken.

Which one runs is ``LlamaConfig.flash_impl`` (``model.flash_impl``): 'xla' (default, every backend),
'pallas' (CUDA GPU), 'splash' (TPU), or '*_interpret' (the kernel under the interpreter, for tests).
Where the kernel cannot express the call — keys that are not the queries' own row, a cache or a
soft-prompt prefix — ``models.attention`` keeps the XLA form.

Shape handling: GQA by repeating each key/value head over its query group (the kernels here take
Hq = Hkv); rows padded to the kernel's 128-query block with a segment id no real token has, so a
padded query sees only padding and a real query never sees it; padded outputs are dropped.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

FLASH_IMPLS = ("xla", "pallas", "pallas_interpret", "splash", "splash_interpret")
_BACKEND_OF = {"pallas": "gpu", "splash": "tpu"}
BLOCK = 128  # query / key block of both kernels (and the row padding)
_PAD_SEGMENT = -1  # segment id of padding positions (real segment ids are >= 0)


def resolve_flash_impl(impl: str, backend: Optional[str] = None) -> str:
    """Validate ``model.flash_impl`` against the backend it will run on: 'pallas' compiles for CUDA GPUs
    only and 'splash' for TPUs only; on another backend asking for one is an error (the '_interpret'
    forms run anywhere, slowly: they are for tests). ``backend`` defaults to the platform compiled for (``devices.compile_platform``)."""
    if impl not in FLASH_IMPLS:
        raise ValueError(f"flash_impl must be one of {FLASH_IMPLS}, got {impl!r}")
    if not backend:
        from confu_jax.devices import compile_platform

        backend = compile_platform()
    need = _BACKEND_OF.get(impl)
    if need is not None and backend != need:
        raise ValueError(f"flash_impl={impl!r} needs a {need.upper()} backend; the backend is {backend!r}. Use "
                         f"'xla' (every backend) or {impl + '_interpret'!r} (the kernel interpreted, for tests)")
    return impl


def _padded(q_bthd, k_bthd, v_bthd, segment_ids_bt):
    """Repeat KV heads to Hq, pad rows to a multiple of BLOCK -> (q, k, v, segment ids [B,T'], T)."""
    b, t, hq, _ = q_bthd.shape
    g = hq // k_bthd.shape[2]
    if g > 1:
        k_bthd, v_bthd = (jnp.repeat(x, g, axis=2) for x in (k_bthd, v_bthd))
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None else jnp.asarray(segment_ids_bt, jnp.int32)
    pad = -t % BLOCK
    if pad:
        q_bthd, k_bthd, v_bthd = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q_bthd, k_bthd, v_bthd))
        seg = jnp.pad(seg, [(0, 0), (0, pad)], constant_values=_PAD_SEGMENT)
    return q_bthd, k_bthd, v_bthd, seg, t


def _pallas_gpu(q, k, v, seg, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    return gpu_attention.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5, causal=True, interpret=interpret)


def _splash_kernel(n_heads: int, t: int, interpret: bool):
    """The kernel for [n_heads, t, D] rows (built per trace: it holds the mask's block tables as arrays,
    which a cache shared across traces would leak)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    blk = min(512, t)
    while t % blk:
        blk //= 2
    sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                              block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(n_heads)])
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q, k, v, seg, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, t, h, d = q.shape
    kernel = _splash_kernel(h, t, interpret)
    q = q * jnp.asarray(d ** -0.5, q.dtype)  # splash leaves the scale to the caller

    def one_row(q_thd, k_thd, v_thd, seg_t):
        out = kernel(*(jnp.swapaxes(x, 0, 1) for x in (q_thd, k_thd, v_thd)),
                     segment_ids=splash.SegmentIds(q=seg_t, kv=seg_t))
        return jnp.swapaxes(out, 0, 1)

    return jax.vmap(one_row)(q, k, v, seg)


def fused_causal_attention(q_bthd: jax.Array, k_bthd: jax.Array, v_bthd: jax.Array, *,
                           segment_ids_bt: Optional[jax.Array] = None, impl: str) -> jax.Array:
    """Causal (segment-local) attention of a row to itself through the fused kernel ``impl``
    ('pallas' / 'splash' or their '_interpret' forms) -> [B,T,Hq,D] in q's dtype."""
    b, t, hq, d = q_bthd.shape
    if k_bthd.shape != v_bthd.shape or k_bthd.shape[:2] != (b, t) or k_bthd.shape[3] != d or hq % k_bthd.shape[2]:
        raise ValueError(f"fused_causal_attention: expected q [B,T,Hq,D], k and v [B,T,Hkv,D] (the row attends to "
                         f"itself) with Hkv dividing Hq; got q {q_bthd.shape}, k {k_bthd.shape}, v {v_bthd.shape}")
    q, k, v, seg, t = _padded(q_bthd, k_bthd, v_bthd, segment_ids_bt)
    kind, _, interpret = impl.partition("_")
    if kind == "pallas":
        out = _pallas_gpu(q, k, v, seg, interpret == "interpret")
    elif kind == "splash":
        out = _splash(q, k, v, seg, interpret == "interpret")
    else:
        raise ValueError(f"fused_causal_attention: impl must be one of {FLASH_IMPLS[1:]}, got {impl!r}")
    return out[:, :t].astype(q_bthd.dtype)
