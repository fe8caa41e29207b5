"""Which attention implementation a target forward runs: the XLA reference or the Pallas kernel.

The attention every target forward computes (cache | soft-prompt prefix | block, defined by
``confu_jax.kernels.attention_reference``) has two implementations: the blockwise jnp version
(``kernels.blockwise_attention``: no concatenated scores or V, native-dtype operands, chunked
prefill), which XLA compiles on every backend and which training differentiates, and the Pallas
tree-attention kernel for CUDA GPUs (inference only; it verifies blocks of up to
``tree_attention.MAX_QUERIES`` queries per row, and longer blocks — prefill — take the blockwise path). ``LlamaConfig.attention_impl`` names one; it is validated
against the backend once, when a config becomes a ``ModelSpec`` (``resolve_attention_impl``), and
refused in training (docs/DESIGN.md §6). A training row attending to itself runs in flash form:
XLA's online softmax, or a fused kernel on an accelerator (``LlamaConfig.flash_impl``,
``kernels.fused_attention``).
"""

from __future__ import annotations

import dataclasses

import jax

from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.kernels.blockwise_attention import masked_attention_blockwise
from confu_jax.kernels.flash_attention import CausalSegments, flash_attention
from confu_jax.kernels.fused_attention import fused_causal_attention
from confu_jax.kernels.tree_attention import ATTENTION_IMPLS


def masked_attention(q_bthd: jax.Array, k_bthd: jax.Array, v_bthd: jax.Array, to: AttendTo, *, impl: str = "xla",
                     flash_impl: str = "xla") -> jax.Array:
    """Dispatch on ``impl``: 'xla' (blockwise jnp, the default) or 'pallas' / 'pallas_interpret' (the kernel).

    A block mask given by its structure (``to.mask`` a ``CausalSegments``: a training row attending to
    itself) runs in flash form when there is no cache or prefix to attend (``kernels.flash_attention``:
    no [T, T] mask or scores) — XLA's form, or with ``flash_impl`` a fused kernel
    (``kernels.fused_attention``); with them it is expanded to its entries."""
    if isinstance(to.mask, CausalSegments):
        seg = to.mask.segment_ids_bt
        if not to.has_cache and not to.has_prefix:
            if flash_impl == "xla":
                return flash_attention(q_bthd, k_bthd, v_bthd, segment_ids_bt=seg)
            return fused_causal_attention(q_bthd, k_bthd, v_bthd, segment_ids_bt=seg, impl=flash_impl)
        to = dataclasses.replace(to, mask=to.mask.dense(q_bthd.shape[0], q_bthd.shape[1]))
    if impl == "xla":
        return masked_attention_blockwise(q_bthd, k_bthd, v_bthd, to)
    if impl in ("pallas", "pallas_interpret"):
        from confu_jax.kernels import tree_attention

        if to.cache_start is not None:  # only packed training rows set it
            raise ValueError(f"attention_impl={impl!r}: the Pallas kernel has no cache_start_bt (a lower bound "
                             "on visible cache slots, used by packed training rows); train with 'xla'")
        if q_bthd.shape[1] > tree_attention.MAX_QUERIES:  # prefill: the chunked XLA path
            return masked_attention_blockwise(q_bthd, k_bthd, v_bthd, to)
        return tree_attention.masked_attention_pallas(q_bthd, k_bthd, v_bthd, to, interpret=(impl == "pallas_interpret"))
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
