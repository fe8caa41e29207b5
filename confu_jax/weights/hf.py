"""Hugging Face checkpoints (``config.json`` + safetensors, single file or sharded) -> params.

Reads Llama, Qwen2 (Qwen2.5) and Qwen3 dense configs as transformers writes them, both the 4.x form
(``rope_theta``, ``rope_scaling``) and the 5.x form (``rope_parameters``). Anything this decoder
does not implement -- another architecture (MoE, Gemma, ...), sliding-window attention, MLP or
output biases, a non-SiLU MLP, a RoPE scaling other than Llama-3's -- is refused by name instead of
being loaded into a model that would silently compute something else.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from confu_jax import storage
from confu_jax.models.llama import LlamaConfig
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.safetensors_io import SafetensorsFile
from confu_jax.weights.tree import assemble

# model_type -> the architectures class transformers writes for it.
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED_MODEL_TYPES.values())
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
    "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
}
_BIASES = {"q_bias": "self_attn.q_proj", "k_bias": "self_attn.k_proj", "v_bias": "self_attn.v_proj"}
_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_name(kind: str, layer: Optional[int]) -> str:
    if layer is None:
        return _GLOBAL_NAMES[kind]
    if kind in _BIASES:
        return f"model.layers.{layer}.{_BIASES[kind]}.bias"
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"


def _ids(v) -> tuple:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))


def rope_from_config(c: dict, where: str) -> tuple:
    """(rope_theta, rope_scaling tuple or None) from either transformers config form."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" in params:  # transformers 5.x
        theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(c.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope scaling type {kind!r} is not supported; expected 'llama3' or none")
    try:
        return theta, (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                       float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise CheckpointError(f"{where}: llama3 rope scaling lacks key {e.args[0]!r}") from None


def config_from_dict(c: dict, where: str = "config.json", dtype: Optional[str] = None) -> LlamaConfig:
    """LlamaConfig from a parsed ``config.json``; ``where`` names the file in errors."""
    archs = c.get("architectures") or []
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or (archs and SUPPORTED_MODEL_TYPES[model_type] not in archs):
        raise CheckpointError(
            f"{where}: model_type {model_type!r}, architectures {archs}; expected one of "
            + ", ".join(f"{t!r} ({a})" for t, a in SUPPORTED_MODEL_TYPES.items())
            + " (MoE, Gemma, sliding-window and other architectures are not supported)"
        )
    if c.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias is true; MLP biases are not supported (expected false)")
    if model_type == "qwen2":  # transformers' Qwen2Attention always has q/k/v biases, o_proj none
        attention_bias = True
    else:  # Llama's and Qwen3's attention_bias biases o_proj as well, which no model here has
        attention_bias = bool(c.get("attention_bias", False))
        if attention_bias:
            raise CheckpointError(f"{where}: attention_bias is true for model_type {model_type!r}; expected false "
                                  "(biases are read only for Qwen2, whose output projection has none)")
    if c.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window is true; expected false (sliding-window attention "
                              "is not supported)")
    layer_types = c.get("layer_types")
    if layer_types and set(layer_types) != {"full_attention"}:
        raise CheckpointError(f"{where}: layer_types has {sorted(set(layer_types))}; expected only 'full_attention'")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act is {c['hidden_act']!r}; expected 'silu'")
    if dtype is None:
        stored = c.get("dtype", c.get("torch_dtype"))
        dtype = stored if stored in FLOAT_DTYPES else "float32"
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} not supported; expected one of {list(FLOAT_DTYPES)}")
    try:
        d, n_heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        theta, scaling = rope_from_config(c, where)
        return LlamaConfig(
            vocab_size=int(c["vocab_size"]),
            d_model=d,
            n_layers=int(c["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
            head_dim=int(c.get("head_dim") or d // n_heads),
            ffn_dim=int(c["intermediate_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            dtype=dtype,
            param_dtype=dtype,
            bos_token_id=_ids(c.get("bos_token_id"))[0] if _ids(c.get("bos_token_id")) else None,
            eos_token_ids=_ids(c.get("eos_token_id")),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None


def read_config(directory: str, dtype: Optional[str] = None) -> LlamaConfig:
    path = os.path.join(directory, "config.json")
    if not storage.isfile(path):
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    with storage.open(path) as f:
        cfg = config_from_dict(json.load(f), path, dtype)
    gen_path = os.path.join(directory, "generation_config.json")
    if storage.isfile(gen_path):  # Llama-3 instruct lists <|eot_id|> here, not in config.json
        with storage.open(gen_path) as f:
            extra = _ids(json.load(f).get("eos_token_id"))
        cfg = cfg.replace(eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    return cfg


def open_tensors(directory: str) -> dict:
    """tensor name -> SafetensorsFile holding it (single file or ``model.safetensors.index.json``)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if storage.isfile(single):
        f = SafetensorsFile(single)
        return {n: f for n in f.names()}
    if storage.isfile(index):
        with storage.open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {}
        for shard in sorted(set(weight_map.values())):
            p = os.path.join(directory, shard)
            if not storage.isfile(p):
                raise CheckpointError(f"{index}: shard {shard!r} listed in weight_map is missing")
            files[shard] = SafetensorsFile(p)
        out = {}
        for name, shard in weight_map.items():
            if name not in files[shard].header:
                raise CheckpointError(f"{index}: tensor {name!r} mapped to {shard!r} but not in that shard")
            out[name] = files[shard]
        return out
    present = sorted(storage.listdir(directory)) if storage.isdir(directory) else []
    raise CheckpointError(
        f"{directory}: expected model.safetensors or model.safetensors.index.json; found {present[:12]}"
        " (convert .bin/.pt checkpoints to safetensors first)"
    )


def _tensor_source(directory: str, cfg: LlamaConfig) -> dict:
    """The ``assemble`` / ``assemble_sharded`` arguments of a directory: names, lazy memory-mapped tensors."""
    where = open_tensors(directory)

    def ignorable(name: str) -> bool:
        # Old checkpoints saved RoPE buffers; tied checkpoints sometimes also save lm_head.
        return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")

    return dict(source=directory, name_of=hf_name, fetch=lambda name: where[name].get(name), available=where,
                ignorable=ignorable)


def load_hf(directory: str, dtype: Optional[str] = None):
    """``(LlamaConfig, params)`` from a Hugging Face directory; dtype defaults to the config's."""
    cfg = read_config(directory, dtype)
    return cfg, assemble(cfg, **_tensor_source(directory, cfg))


def load_hf_sharded(directory: str, shardings: dict, dtype: Optional[str] = None, counter=None):
    """``(LlamaConfig, params)`` with every parameter placed straight into ``shardings``: each process
    reads only its devices' slices of the memory-mapped safetensors (``weights.tree.assemble_sharded``)."""
    from confu_jax.weights.tree import assemble_sharded

    cfg = read_config(directory, dtype)
    return cfg, assemble_sharded(cfg, shardings, counter=counter, **_tensor_source(directory, cfg))
