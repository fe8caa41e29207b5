"""Export ``(LlamaConfig, params)`` as a Hugging Face directory transformers can load.

Lets a GGUF-loaded (dequantised) model be handed to transformers, vLLM or our own HF loader, and
gives tests a round trip that checks the name maps in both directions.
"""

from __future__ import annotations

import json
import os

import numpy as np

from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.hf import SUPPORTED_MODEL_TYPES, hf_name
from confu_jax.weights.safetensors_io import save_file
from confu_jax.weights.tree import GLOBAL_PARAMS, LAYER_PARAMS, check_tree


def model_type_of(cfg: LlamaConfig) -> str:
    """The transformers model_type whose block ``cfg`` computes: Qwen3 (q/k norms), Qwen2 (q/k/v
    biases) or Llama (neither)."""
    if cfg.qk_norm and cfg.attention_bias:
        raise ValueError("no transformers architecture has both per-head q/k norms and q/k/v biases")
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"


def hf_config_dict(cfg: LlamaConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        factor, low, high, ctx = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                    original_max_position_embeddings=ctx)
    eos = list(cfg.eos_token_ids)
    model_type = model_type_of(cfg)
    return {
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,  # Qwen2's q/k/v biases (its config class ignores the key)
        "mlp_bias": False,
        "use_sliding_window": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": cfg.param_dtype,
    }


def save_hf(cfg: LlamaConfig, params: dict, directory: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` (one file; params keep their dtype)."""
    check_tree(cfg, params, "save_hf params")
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for path, kind in GLOBAL_PARAMS.items():
        if path[0] in params:
            w = np.asarray(params[path[0]][path[1]])
            tensors[hf_name(kind, None)] = w.T if path[1] == "kernel" else w
    for path, kind in LAYER_PARAMS.items():
        if path[1] not in params["layers"].get(path[0], {}):  # Qwen-only tensors
            continue
        stacked = np.asarray(params["layers"][path[0]][path[1]])
        for i in range(cfg.n_layers):
            tensors[hf_name(kind, i)] = stacked[i].T if path[1] == "kernel" else stacked[i]
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2)
