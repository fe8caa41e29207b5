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

import jax

from confu_jax.kernels.blockwise_attention import masked_attention_blockwise
from confu_jax.kernels.flash_attention import CausalSegments, flash_attention
from confu_jax.kernels.fused_attention import fused_causal_attention
from confu_jax.kernels.tree_attention import ATTENTION_IMPLS


def masked_attention(*args, impl: str = "xla", flash_impl: str = "xla", **kwargs) -> jax.Array:
    """Dispatch on ``impl``: 'xla' (blockwise jnp, the default) or 'pallas' / 'pallas_interpret' (the kernel).

    A block mask given by its structure (``CausalSegments``: a training row attending to itself) runs
    in flash form when there is no cache or prefix to attend (``kernels.flash_attention``: no [T, T]
    mask or scores) — XLA's form, or with ``flash_impl`` a fused kernel (``kernels.fused_attention``); with
    them it is expanded to its entries."""
    if isinstance(args[3], CausalSegments):
        q, k, v, mask = args[:4]
        empty = all(kwargs.get(name) is None or kwargs[name].shape[0 if name == "k_prefix_phd" else 2] == 0
                    for name in ("k_cache_bhsd", "k_prefix_phd"))
        if empty and len(args) == 4:
            if flash_impl == "xla":
                return flash_attention(q, k, v, segment_ids_bt=mask.segment_ids_bt)
            return fused_causal_attention(q, k, v, segment_ids_bt=mask.segment_ids_bt, impl=flash_impl)
        args = args[:3] + (mask.dense(q.shape[0], q.shape[1]),) + args[4:]
    if impl == "xla":
        return masked_attention_blockwise(*args, **kwargs)
    if impl in ("pallas", "pallas_interpret"):
        from confu_jax.kernels import tree_attention

        if kwargs.pop("cache_start_bt", None) is not None:  # only packed training rows set it
            raise ValueError(f"attention_impl={impl!r}: the Pallas kernel has no cache_start_bt (a lower bound "
                             "on visible cache slots, used by packed training rows); train with 'xla'")

        if args[0].shape[1] > tree_attention.MAX_QUERIES:  # prefill: the chunked XLA path
            return masked_attention_blockwise(*args, **kwargs)
        return tree_attention.masked_attention_pallas(
            *args, interpret=(impl == "pallas_interpret"), **kwargs
        )
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
