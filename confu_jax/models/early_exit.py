"""The early-exit self-drafter: the target's first N layers + its final norm and LM head as a
standalone Llama (draft source ``self:N``; docs/DESIGN.md §11 "Independent draft models and SD²").

Its config is the target's with ``n_layers = N``; its weights are the target's (the layer stack
sliced, or on the layer-unrolled path the target's own first N per-layer buffers: no copy).
"""

from __future__ import annotations

from typing import Optional

import jax

from confu_jax.models.llama import LlamaConfig
from confu_jax.models.unrolled import SplitParams

SELF_PREFIX = "self:"  # draft source 'self:N'


def early_exit_config(target: LlamaConfig, n_layers: int) -> LlamaConfig:
    """The target's first ``n_layers`` layers as a standalone Llama (same widths, norm, LM head)."""
    if not 1 <= n_layers <= target.n_layers:
        raise ValueError(f"early-exit drafter: n_layers must be in [1, {target.n_layers}] (the target's "
                         f"layers), got {n_layers}")
    return target.replace(n_layers=int(n_layers))


def early_exit_params(target_params, n_layers: int):
    """The self-drafter's weights from the target's: the first ``n_layers`` of the layer stack (a
    slice; for ``SplitParams`` the same per-layer buffers) + embedding, final norm, LM head."""
    if isinstance(target_params, SplitParams):
        return SplitParams(target_params.shared, tuple(target_params.layers[:n_layers]))
    return dict(target_params, layers=jax.tree_util.tree_map(lambda x: x[:n_layers], target_params["layers"]))


def is_early_exit_of(draft: LlamaConfig, target: LlamaConfig) -> bool:
    """Whether ``draft`` is ``target`` cut after its first ``draft.n_layers`` layers."""
    return (draft.n_layers <= target.n_layers
            and draft.replace(n_layers=target.n_layers, attention_impl=target.attention_impl,
                              flash_impl=target.flash_impl) == target)


def parse_self_source(source: str, target: LlamaConfig) -> Optional[int]:
    """'self:N' -> N (checked against the target's depth); any other source -> None."""
    if not source.startswith(SELF_PREFIX):
        return None
    arg = source[len(SELF_PREFIX):]
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(f"draft model source {source!r}: expected self:N with N an integer number of the "
                         f"target's layers (1..{target.n_layers})") from None
    early_exit_config(target, n)  # range check
    return n


def default_self_layers(target: LlamaConfig) -> int:
    """The embedded default's depth: a quarter of the target's layers (at least 1)."""
    return max(1, target.n_layers // 4)
