"""What speculators' DFlash-family layouts share (``dspark``, ``dflash2``; speculators 0.9 ``models/dflash/config.py``
``DFlashSpeculatorConfig`` and ``models/dflash/core.py``): the config's ``transformer_layer_config`` (a Qwen3 layer
stack), ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``,
``sample_from_anchor``, the ``speculators_config`` block — and a full-vocabulary draft saves neither
``embed_tokens`` nor ``lm_head`` (both are the verifier's). ``aux_hidden_state_layer_ids`` are hidden-state indices
as speculators and vLLM capture them (id i = the state entering layer i): this project's taps as they are.

Why one module: the two family formats differ only in their own tensors and config fields (``weights.dspark_format``,
``weights.dflash2_format``).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.export import hf_config_dict
from confu_jax.weights.head_dirs import dtype_name, read_config_json
from confu_jax.weights.hf import config_from_dict
from confu_jax.weights.safetensors_io import save_file
from confu_jax.weights.tensor_files import read_tensors

_VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                     "d2t", "t2d")


class BlockDir(NamedTuple):
    config: dict  # config.json
    draft: LlamaConfig  # the layer stack's config
    taps: tuple
    tensors: dict  # the draft's own tensors (no ``model.`` prefix, no verifier tensors)
    where: str  # config.json's path, for errors


def is_kind(path: str, kind: str) -> bool:
    c = read_config_json(path) if os.path.isdir(path) else None
    return c is not None and c.get("speculators_model_type") == kind


def read_block_dir(directory: str, kind: str, *, sample_from_anchor: bool, family: str) -> BlockDir:
    """A speculators directory of ``kind`` with its shared fields checked: a full-vocabulary draft of full-attention
    layers whose block is read as ``sample_from_anchor`` says (DSpark: true; DFlash2: false)."""
    where = os.path.join(directory, "config.json")
    c = read_config_json(directory)
    if c is None or c.get("speculators_model_type") != kind:
        raise ValueError(f"{where}: expected speculators_model_type {kind!r} (a {family} draft)")
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{where}: transformer_layer_config is {type(tl).__name__}; expected an object")
    kinds = set(tl.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{where}: transformer_layer_config.layer_types {sorted(kinds)}: only full-attention draft "
                         "layers are read (sliding-window draft layers are not built here)")
    plain = {k: v for k, v in tl.items() if k not in ("architectures", "layer_types")}
    # config_from_dict reads the shared Llama / Qwen3 fields; the draft is a Qwen3 layer stack (models.dflash)
    draft = config_from_dict({**plain, "model_type": "llama"}, f"{where} transformer_layer_config")
    default_anchor = kind == "dspark"  # speculators' defaults: DSpark reads from the anchor, DFlash's family not
    if bool(c.get("sample_from_anchor", default_anchor)) is not sample_from_anchor:
        raise ValueError(f"{where}: sample_from_anchor is {c.get('sample_from_anchor')!r}; {family}'s block "
                         f"{'drafts from its anchor slot (true)' if sample_from_anchor else 'starts at its anchor (false)'}"
                         f": a block read the other way is the {'dflash' if sample_from_anchor else 'dspark'} family's")
    dv = int(c.get("draft_vocab_size") or draft.vocab_size)
    if dv != draft.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {dv} < the vocabulary {draft.vocab_size}: a reduced draft "
                         "vocabulary (lm_head + d2t) is not read yet; expected a full-vocabulary draft")
    for key in ("mask_token_id", "block_size", "aux_hidden_state_layer_ids"):
        if c.get(key) is None:
            raise ValueError(f"{where}: {key} is missing")
    taps = tuple(int(i) for i in c["aux_hidden_state_layer_ids"])
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in read_tensors(directory).items()}
    return BlockDir(c, draft, taps, {k: v for k, v in sd.items() if k not in _VERIFIER_TENSORS}, where)


def write_block_dir(directory: str, tensors: dict, draft: LlamaConfig, *, kind: str, arch: str, taps,
                    mask_token_id: int, block_size: int, sample_from_anchor: bool, fields: dict,
                    verifier: Optional[str], verifier_arch: str, dtype) -> str:
    """``config.json`` + ``model.safetensors`` in speculators' layout of ``kind`` (``fields``: the family's own)."""
    layer = {k: v for k, v in hf_config_dict(draft).items() if k not in ("dtype",)}
    layer.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], layer_types=["full_attention"] * draft.n_layers,
                 use_sliding_window=False, sliding_window=None)
    config = {
        "architectures": [arch], "speculators_model_type": kind, "speculators_version": "0.9.0",
        "dtype": dtype_name(dtype), "transformer_layer_config": layer, "draft_vocab_size": int(draft.vocab_size),
        "block_size": int(block_size), "target_hidden_size": None, "aux_hidden_state_layer_ids": [int(t) for t in taps],
        "mask_token_id": int(mask_token_id), "sliding_window_non_causal": False,
        "sample_from_anchor": bool(sample_from_anchor), **fields,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(block_size) - (0 if sample_from_anchor else 1),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [verifier_arch]}},
    }
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(np.asarray(v, dtype)) for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory
