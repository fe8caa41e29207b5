"""Our loaders + Llama forward vs transformers' LlamaForCausalLM on tiny random checkpoints.

Checkpoints are written by transformers' ``save_pretrained`` (safetensors; single file and
sharded) and by the ``gguf`` writer in llama.cpp's layout, so both name maps, the kernel
transposes, the GGUF Q/K un-permute and the Llama-3 RoPE scaling are checked against an
implementation no one here wrote.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from confu_jax.models.llama import Llama
from confu_jax.weights import load_model, save_hf
from tests.helpers.tiny_checkpoints import hf_llama, write_gguf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
T = 40  # longer than original_max_position_embeddings, so scaled and unscaled RoPE differ


def _tokens(vocab, seed=1, b=2):
    return np.random.default_rng(seed).integers(0, vocab, (b, T)).astype(np.int32)


def _ours(cfg, params, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = Llama(cfg).apply({"params": params}, jnp.asarray(tokens), pos)
    return np.asarray(out.logits_btv)


def _theirs(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


CASES = {
    "gqa_untied": dict(tie=False),
    "gqa_tied": dict(tie=True),
    "mha_tied": dict(tie=True, heads=4, kv_heads=4),
    "llama3_rope": dict(tie=False, rope_scaling=LLAMA3, rope_theta=500000.0),
    "llama3_rope_tied_mqa": dict(tie=True, rope_scaling=LLAMA3, heads=4, kv_heads=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_safetensors_logits_match_transformers(tmp_path, case):
    model = hf_llama(tmp_path, seed=hash(case) % 1000, **CASES[case])
    cfg, params = load_model(str(tmp_path))
    assert cfg.tie_embeddings == CASES[case]["tie"]
    assert ("lm_head" in params) != cfg.tie_embeddings
    if "rope_scaling" in CASES[case]:
        assert cfg.rope_scaling == (8.0, 1.0, 4.0, 32)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    toks = _tokens(cfg.vocab_size)
    err = np.abs(_ours(cfg, params, toks) - _theirs(model, toks)).max()
    assert err <= 1e-4, f"{case}: max |logit diff| {err}"


def test_sharded_index_loads_same_params(tmp_path):
    model = hf_llama(tmp_path / "sharded", seed=3, max_shard_size="40KB")
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    cfg, params = load_model(str(tmp_path / "sharded"))
    toks = _tokens(cfg.vocab_size)
    assert np.abs(_ours(cfg, params, toks) - _theirs(model, toks)).max() <= 1e-4


def test_bf16_checkpoint_keeps_dtype_and_casts_on_request(tmp_path):
    hf_llama(tmp_path, seed=4, dtype="bfloat16")
    cfg, params = load_model(str(tmp_path))
    assert cfg.param_dtype == "bfloat16" and params["embed"]["embedding"].dtype == jnp.bfloat16
    cfg32, params32 = load_model(str(tmp_path), dtype="float32")
    assert params32["layers"]["q_proj"]["kernel"].dtype == jnp.float32
    # bf16 -> f32 is exact, so the f32 copy equals transformers' bf16 weights upcast (loaded
    # fresh: .float() on a bf16 module would keep its bf16-rounded RoPE buffer).
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    toks = _tokens(cfg.vocab_size)
    assert np.abs(_ours(cfg32, params32, toks) - _theirs(ref, toks)).max() <= 1e-4


def test_save_hf_round_trip_loads_in_transformers(tmp_path):
    hf_llama(tmp_path / "src", seed=5, rope_scaling=LLAMA3, tie=False)
    cfg, params = load_model(str(tmp_path / "src"))
    save_hf(cfg, params, str(tmp_path / "out"))
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    toks = _tokens(cfg.vocab_size)
    assert np.abs(_ours(cfg, params, toks) - _theirs(reloaded, toks)).max() <= 1e-4
    cfg2, params2 = load_model(str(tmp_path / "out"))
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def _llamacpp_rope_freqs(theta, head_dim, factor, low, high, ctx):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (Llama-3 rope factors)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wl, high_wl = ctx / low, ctx / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            s = (ctx / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("case", ["gqa_untied", "gqa_tied", "llama3_rope"])
def test_gguf_llamacpp_layout_logits_match_transformers(tmp_path, case):
    kw = dict(CASES[case])
    freqs = None
    if "rope_scaling" in kw:
        # llama.cpp writes divisors for Llama-3's own original context (8192).
        kw["rope_scaling"] = dict(LLAMA3, original_max_position_embeddings=8192)
        freqs = _llamacpp_rope_freqs(kw["rope_theta"], 16, 8.0, 1.0, 4.0, 8192)
    model = hf_llama(tmp_path / "hf", seed=7, vocab=300, **kw)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, model, rope_freqs=freqs)
    cfg, params = load_model(path)
    assert cfg.tie_embeddings == kw["tie"]
    if freqs is not None:
        assert cfg.rope_scaling == (8.0, 1.0, 4.0, 8192)
    toks = _tokens(cfg.vocab_size)
    err = np.abs(_ours(cfg, params, toks) - _theirs(model, toks)).max()
    assert err <= 1e-4, f"{case}: max |logit diff| {err}"


# config.json of the released checkpoints (transformers 4.x form: rope_theta + rope_scaling).
LLAMA32_3B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 49152,
}


@pytest.mark.parametrize("raw,preset", [(LLAMA32_3B_CONFIG, "llama-3.2-3b"), (SMOLLM2_135M_CONFIG, "smollm2-135m")])
def test_released_hf_configs_parse_to_presets(raw, preset):
    from confu_jax.models.llama import rope_inv_freq
    from confu_jax.models.presets import get_preset
    from confu_jax.weights.hf import config_from_dict
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config_from_dict(raw, preset)
    assert cfg.param_dtype == "bfloat16"
    assert cfg == get_preset(preset).replace(dtype="bfloat16", param_dtype="bfloat16")
    # Our inverse frequencies equal transformers' for the same config.json.
    hf = HFConfig(**raw)
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        inv = 1.0 / (hf.rope_parameters["rope_theta"] ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    else:
        inv = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")[0].numpy()
    np.testing.assert_allclose(rope_inv_freq(cfg), inv, rtol=1e-6)
