"""MTP modules in DeepSeek-V3's published layout (docs/DESIGN.md §11 "MTP module").

Why: DeepSeek-V3's checkpoint stores its MTP module as one more decoder layer after the main model's,
``model.layers.{N}.*`` with N = ``num_hidden_layers`` and ``num_nextn_predict_layers`` in config.json;
vLLM (``deepseek_mtp.py``, ``DeepSeekMTP.load_weights``) and SGLang (``deepseek_nextn.py``, which also
reads the layer re-exported as ``model.layers.0``) load it by these names::

    model.layers.{N}.enorm.weight  [d]              model.layers.{N}.hnorm.weight  [d]
    model.layers.{N}.eh_proj.weight  [d, 2d]        (input columns: enorm(Emb) first, then hnorm(h))
    model.layers.{N}.shared_head.norm.weight  [d]
    model.layers.{N}.<decoder layer>                 here a Llama layer: input_layernorm, self_attn.{q,k,v,o}_proj,
                                                     post_attention_layernorm, mlp.{gate,up,down}_proj
    model.layers.{N}.embed_tokens.weight  [V, d]    model.layers.{N}.shared_head.head.weight  [V, d]
                                                     (optional here: copies of the target's, which SGLang skips
                                                     and vLLM shares; on import they are checked, never used)

DeepSeek's own block is MLA + MoE; no serving engine runs an MTP layer with a Llama block today, so the
directory is DeepSeek's names around a Llama layer, and its ``config.json`` is the target's Llama config
(``weights.export.hf_config_dict``, ``num_hidden_layers`` = the MTP layer's index) plus
``num_nextn_predict_layers: 1``. ``load_mtp_dir`` also reads a directory whose file holds the main
model's layers beside the MTP layer (only layer N is read).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.models.mtp import from_reference_state_dict, to_reference_state_dict
from confu_jax.models.unrolled import shared_params
from confu_jax.weights.tensor_files import read_tensors
from confu_jax.weights.export import hf_config_dict
from confu_jax.weights.head_dirs import dtype_name, read_config_json
from confu_jax.weights.hf import config_from_dict
from confu_jax.weights.safetensors_io import save_file

MARKER = "num_nextn_predict_layers"


class ImportedMTP(NamedTuple):
    params: dict  # models.mtp tree (numpy float32)
    block: LlamaConfig  # the layer's configuration (config.json)
    layer_index: int  # N of model.layers.{N}
    shared: dict  # {'embed_tokens.weight' / 'shared_head.head.weight': [V, d]} copies the file carries
    source: str


def is_mtp_dir(path: str) -> bool:
    """A directory whose config.json has ``num_nextn_predict_layers`` >= 1."""
    c = read_config_json(path) if os.path.isdir(path) else None
    try:
        return c is not None and int(c.get(MARKER) or 0) >= 1
    except (TypeError, ValueError):
        return False


def load_mtp_dir(directory: str) -> ImportedMTP:
    """A DeepSeek-layout MTP directory with a Llama block -> our tree (float32), every shape checked
    against its config.json (the first MTP layer, N = ``num_hidden_layers``)."""
    directory = os.path.abspath(os.path.expanduser(directory))
    c = read_config_json(directory)
    if c is None or not is_mtp_dir(directory):
        raise ValueError(f"{directory}: expected a config.json with {MARKER} >= 1 (a DeepSeek-layout MTP module)")
    if c.get("model_type") != "llama":
        raise ValueError(f"{directory}: model_type {c.get('model_type')!r}: only MTP modules with a Llama decoder "
                         "layer load here (DeepSeek-V3's own MTP layer is MLA + MoE)")
    block = config_from_dict({k: v for k, v in c.items() if k != "architectures"}, f"{directory}/config.json")
    try:
        params, index, shared = from_reference_state_dict(read_tensors(directory), block, block.n_layers)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return ImportedMTP(params, block, index, shared, directory)


def target_shared(target_cfg: LlamaConfig, target_params) -> dict:
    """The target's embedding and LM head as the MTP layer's ``embed_tokens`` / ``shared_head.head`` [V, d]."""
    sp = shared_params(target_params)
    emb = np.asarray(sp["embed"]["embedding"])
    head = emb if target_cfg.tie_embeddings else np.asarray(sp["lm_head"]["kernel"]).T
    return {"embed_tokens.weight": emb, "shared_head.head.weight": head}


def check_shared(imported: ImportedMTP, target_cfg: LlamaConfig, target_params) -> None:
    """Refuse a module whose file carries another model's embedding or LM head (up to the rounding of a
    bfloat16 export)."""
    mine = target_shared(target_cfg, target_params)
    for name, x in imported.shared.items():
        want = mine[name].astype(np.float32)
        x = np.asarray(x, np.float32)
        if x.shape != want.shape or not np.allclose(x, want, rtol=1e-2, atol=1e-2 * float(np.abs(want).max())):
            raise ValueError(f"{imported.source}: its {name} {x.shape} is not the target's {want.shape}: the module "
                             "was exported for another target")


def save_mtp_dir(directory: str, params: dict, target_cfg: LlamaConfig, *, target_params=None,
                 dtype=np.float32) -> None:
    """Write ``model.safetensors`` + ``config.json``; with ``target_params`` also the target's embedding and
    LM head as ``embed_tokens`` / ``shared_head.head`` (``dtype``: float32, float16 or bfloat16)."""
    torch_dtype = dtype_name(dtype)
    n = target_cfg.n_layers
    sd = to_reference_state_dict(params, n)
    if target_params is not None:
        sd.update({f"model.layers.{n}.{k}": v for k, v in target_shared(target_cfg, target_params).items()})
    cfg = {k: v for k, v in hf_config_dict(target_cfg).items() if k not in ("architectures", "dtype")}
    cfg.update({MARKER: 1, "torch_dtype": torch_dtype})
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(np.asarray(v, dtype)) for k, v in sd.items()},
              os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
