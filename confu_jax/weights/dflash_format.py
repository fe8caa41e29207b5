"""DFlash drafters in the published layout (docs/DESIGN.md §11 "DFlash").

Why: z-lab's released drafters (e.g. ``z-lab/Qwen3-8B-DFlash-b16``, ``z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat``)
are Hugging Face directories that ``AutoModel.from_pretrained(..., trust_remote_code=True)`` loads as the
reference's ``DFlashDraftModel`` (z-lab/dflash ``dflash/model.py`` @44947fb), vLLM / SGLang / tpu-inference
serve them (``"method": "dflash"``), and SpecForge writes the same layout
(``configs/qwen3-8b-dflash.json`` @a6b6b02)::

    config.json        model_type "qwen3", architectures ["DFlashDraftModel"], the draft's Qwen3 layer
                       config (hidden_size = the target's, num_hidden_layers, heads, head_dim,
                       intermediate_size, rms_norm_eps, rope_theta / rope_scaling), block_size,
                       num_target_layers, dflash_config {mask_token_id, target_layer_ids[, causal_head]}
    model.safetensors  fc.weight [d, m*d], hidden_norm.weight, norm.weight,
                       layers.{i}.{input_layernorm, post_attention_layernorm}.weight,
                       layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
                       layers.{i}.mlp.{gate,up,down}_proj.weight       (a ``model.`` prefix is accepted)

The embedding and LM head are the target's (the reference calls ``target.model.embed_tokens`` and
``target.lm_head``); the file holds none. ``target_layer_ids`` are HF ``hidden_states`` indices minus one
(outputs of those layers): this project's taps ``l + 1`` (``models.dflash.taps_for_layer_ids``).
Without ``target_layer_ids`` the reference's ``build_target_layer_ids(num_target_layers, num_hidden_layers)``.

JetSpec's heads (hao-ai-lab/JetSpec ``jetspec/models/draft_head.py`` @2c7b3fa, e.g. ``JetSpec/jetspec-qwen3-8b``)
are this layout with ``dflash_config.causal_head: true`` (its ``DFlashDraftModel`` reads the flag, default
false: the block attends causally inside): ``causal_head`` on import and export.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from confu_jax.models.dflash import (build_target_layer_ids, from_reference_state_dict, taps_for_layer_ids,
                                     to_reference_state_dict)
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.tensor_files import read_tensors
from confu_jax.weights.export import hf_config_dict
from confu_jax.weights.head_dirs import dtype_name, read_config_json
from confu_jax.weights.hf import config_from_dict
from confu_jax.weights.safetensors_io import save_file

ARCHITECTURE = "DFlashDraftModel"


class ImportedDFlash(NamedTuple):
    params: dict  # models.dflash tree (numpy float32), no mask_token_id
    draft: LlamaConfig  # the draft's layer config
    block_size: int
    mask_token_id: int
    taps: tuple  # this project's taps (target_layer_ids + 1)
    num_target_layers: int
    source: str
    causal_head: bool = False  # dflash_config.causal_head: a JetSpec head (the block attends causally)
    head: dict = {}  # a projector's own tensors (``projector``: Domino's), under their published names
    dflash_config: dict = {}


def is_dflash_dir(path: str) -> bool:
    """A directory whose config.json names ``DFlashDraftModel`` or has a ``dflash_config``."""
    c = read_config_json(path) if os.path.isdir(path) else None
    return c is not None and (ARCHITECTURE in (c.get("architectures") or []) or isinstance(c.get("dflash_config"),
                                                                                           dict))


def load_dflash_dir(directory: str, projector=None, head_prefixes=()) -> ImportedDFlash:
    """A published DFlash directory -> our tree (float32), every shape checked against its config.json.
    ``projector``: the ``dflash_config.projector_type`` expected (None: plain DFlash / JetSpec; SpecForge's
    ``'domino'``: ``weights.domino_format``), whose tensors — names starting with ``head_prefixes``, SpecForge's
    older ``logit_head.`` container dropped — come back apart in ``head``."""
    directory = os.path.abspath(os.path.expanduser(directory))
    c = read_config_json(directory)
    if c is None or not is_dflash_dir(directory):
        raise ValueError(f"{directory}: expected a config.json with architectures [{ARCHITECTURE!r}] or a "
                         "dflash_config (a DFlash drafter)")
    if c.get("model_type") not in ("qwen3", "llama"):
        raise ValueError(f"{directory}: model_type {c.get('model_type')!r}; the DFlash draft is a Qwen3 layer stack")
    dc = c.get("dflash_config") or {}
    if dc.get("mask_token_id") is None:
        raise ValueError(f"{directory}: config.json has no dflash_config.mask_token_id")
    if dc.get("projector_type") != projector:
        found = dc.get("projector_type")
        raise ValueError(f"{directory}: dflash_config.projector_type is {found!r}: a "
                         f"{found or 'plain DFlash'} draft; decode it with --method {found or 'dflash'}")
    plain = {k: v for k, v in c.items() if k not in ("architectures", "auto_map", "dflash_config", "layer_types")}
    plain["model_type"] = "llama"  # config_from_dict reads the shared Llama / Qwen3 fields
    draft = config_from_dict(plain, f"{directory}/config.json")
    n_target = int(c.get("num_target_layers") or 0)
    ids = dc.get("target_layer_ids") or (build_target_layer_ids(n_target, draft.n_layers) if n_target else None)
    if not ids:
        raise ValueError(f"{directory}: neither dflash_config.target_layer_ids nor num_target_layers")
    sd, head = {}, {}
    for k, v in read_tensors(directory).items():
        k = k[len("model."):] if k.startswith("model.") else k
        k = k[len("logit_head."):] if k.startswith("logit_head.") else k
        (head if head_prefixes and k.startswith(tuple(head_prefixes)) else sd)[k] = v
    try:
        params = from_reference_state_dict(sd, draft, len(ids))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return ImportedDFlash(params, draft, int(c.get("block_size") or 16), int(dc["mask_token_id"]),
                          taps_for_layer_ids(ids), n_target, directory, bool(dc.get("causal_head", False)), head, dc)


def save_dflash_dir(directory: str, params: dict, draft: LlamaConfig, *, taps, mask_token_id: int, block_size: int,
                    num_target_layers: int, dtype=np.float32, causal_head: bool = False, head=None,
                    dflash_config=None, architecture: str = ARCHITECTURE) -> None:
    """Write ``model.safetensors`` + ``config.json`` (``dtype``: float32, float16 or bfloat16; ``causal_head``:
    a JetSpec head, written as ``dflash_config.causal_head: true``; ``head`` / ``dflash_config`` /
    ``architecture``: a projector's tensors, config keys and class, SpecForge's Domino)."""
    ids = [int(t) - 1 for t in taps]
    cfg = {k: v for k, v in hf_config_dict(draft).items() if k not in ("dtype",)}
    module = "dflash" if architecture == ARCHITECTURE else architecture.removesuffix("DraftModel").lower()
    cfg.update({"architectures": [architecture], "model_type": "qwen3",
                "auto_map": {"AutoModel": f"{module}.{architecture}"}, "block_size": int(block_size),
                "num_target_layers": int(num_target_layers),
                "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": ids,
                                  **({"causal_head": True} if causal_head else {}), **(dflash_config or {})},
                "layer_types": ["full_attention"] * draft.n_layers, "use_sliding_window": False,
                "sliding_window": None, "torch_dtype": dtype_name(dtype)})
    os.makedirs(directory, exist_ok=True)
    sd = {**to_reference_state_dict(params), **(head or {})}
    save_file({k: np.ascontiguousarray(np.asarray(v, dtype)) for k, v in sd.items()},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
