"""DFlash2 drafts in speculators' ``dflash2`` layout (what vLLM's ``DFlash2Qwen3ForCausalLM`` loads), in and out.

Read from speculators 0.9 ``models/dflash2/config.py`` (``DFlash2SpeculatorConfig``: DFlash's speculators config,
``weights.speculators_blocks``, plus ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
``selector_top_k``) and ``models/dflash2/model_definitions.py`` / ``core.py`` (tensor names; DFlash2 requires the
full verifier vocabulary), and vLLM 0.32's ``qwen3_dflash2.py`` (the same names; it reads ``selector_top_k``,
``conv_*`` and ``selector_rank`` from the config).

Tensors: the DFlash backbone's (``models.dflash``'s reference names) with ``layers.{i}.{attention,mlp}_conv.
{base_kernel [2, K, d], kernel_projection.weight [2·K·G, d]}``, and ``candidate_selector.{predecessor_codebook
[V, r], successor_codebook [V, r], hidden_projection.weight [r, d]}``.

Not read: a reduced draft vocabulary, ``sample_from_anchor`` true (DSpark's reading of the block), sliding-window
draft layers, vLLM's optional ``input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping`` at
values other than their identities.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import numpy as np

from confu_jax.models import dflash2 as D2
from confu_jax.models.dflash import from_reference_state_dict, to_reference_state_dict
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.speculators_blocks import is_kind, read_block_dir, write_block_dir

KIND = "dflash2"
ARCH = "DFlash2DraftModel"
_SELECTOR = {"candidate_selector.predecessor_codebook": ("predecessor_codebook", False),
             "candidate_selector.successor_codebook": ("successor_codebook", False),
             "candidate_selector.hidden_projection.weight": ("hidden_projection", True)}
_IDENTITIES = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}


class ImportedDFlash2(NamedTuple):
    params: dict  # models.dflash2 tree (numpy float32), no decode scalars
    draft: LlamaConfig
    block_size: int
    mask_token_id: int
    top_k: int
    taps: tuple
    source: str


def is_dflash2_dir(path: str) -> bool:
    return is_kind(path, KIND)


def load_dflash2_dir(directory: str) -> ImportedDFlash2:
    """A speculators DFlash2 directory -> our tree (float32), every shape and setting checked."""
    directory = os.path.abspath(os.path.expanduser(directory))
    c, draft, taps, sd, where = read_block_dir(directory, KIND, sample_from_anchor=False, family="DFlash2")
    for key, ident in _IDENTITIES.items():
        if float(c.get(key) or ident) != ident:
            raise ValueError(f"{where}: {key} {c[key]!r}; only {ident} (no scaling) is read")
    k, g, rank, top = (int(c.get(name, dflt)) for name, dflt in (
        ("conv_kernel_size", 2), ("conv_group_size", 16), ("selector_rank", 256), ("selector_top_k", 16)))
    if k < 1 or g < 1 or draft.d_model % g or rank < 1 or not 1 <= top <= draft.vocab_size:
        raise ValueError(f"{where}: conv_kernel_size {k}, conv_group_size {g}, selector_rank {rank}, selector_top_k "
                         f"{top}: expected K, r >= 1, a group size dividing the width {draft.d_model}, 1 <= top_k <= "
                         f"{draft.vocab_size}")
    selector = {k_: sd.pop(k_) for k_ in list(sd) if k_ in _SELECTOR}
    try:
        params = dict(from_reference_state_dict(sd, draft, len(taps), conv=(k, g)))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    params["selector"] = {}
    for name, x in selector.items():
        leaf, transpose = _SELECTOR[name]
        x = np.asarray(x, np.float32)
        params["selector"][leaf] = np.ascontiguousarray(x.T if transpose else x)
    want = D2.init_shapes(draft, len(taps), draft.vocab_size, kernel_size=k, group_size=g, rank=rank)["selector"]
    got = {n: tuple(np.shape(v)) for n, v in params["selector"].items()}
    need = {n: tuple(v.shape) for n, v in want.items()}
    if got != need:
        raise ValueError(f"{directory}: the candidate selector's tensors {got} do not match the config's {need}")
    return ImportedDFlash2(params, draft, int(c["block_size"]), int(c["mask_token_id"]), top, taps, directory)


def save_dflash2_dir(directory: str, params: dict, draft: LlamaConfig, *, taps, mask_token_id: int, block_size: int,
                     top_k: int, verifier: Optional[str] = None, verifier_arch: str = "Qwen3ForCausalLM",
                     dtype=np.float32) -> str:
    """Write ``config.json`` + ``model.safetensors`` in speculators' layout (``dtype``: float32, float16, bfloat16)."""
    sd = to_reference_state_dict(D2.backbone(params))
    for name, (leaf, transpose) in _SELECTOR.items():
        x = np.asarray(params["selector"][leaf])
        sd[name] = np.ascontiguousarray(x.T if transpose else x)
    k, g = D2.conv(params)
    fields = {"conv_kernel_size": k, "conv_group_size": g, "selector_rank": D2.selector_rank(params),
              "selector_top_k": int(top_k)}
    return write_block_dir(directory, sd, draft, kind=KIND, arch=ARCH, taps=taps, mask_token_id=mask_token_id,
                           block_size=block_size, sample_from_anchor=False, fields=fields, verifier=verifier,
                           verifier_arch=verifier_arch, dtype=dtype)
