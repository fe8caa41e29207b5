"""Qwen2 / Qwen2.5 and Qwen3 dense targets: our loader + forward vs transformers' own classes.

Tiny random checkpoints written by transformers' ``save_pretrained`` (``Qwen2ForCausalLM``: q/k/v
biases; ``Qwen3ForCausalLM``: per-head q/k RMSNorm, head_dim independent of the width). Every
weight, bias and norm scale is random, so a dropped bias, a norm applied after RoPE or over the
wrong axis, or a swapped tensor shows in the logits. Both forwards are checked: the layer scan
(training) and the unrolled one (CPU decoding). The CLI check is the issue's bar: ``launch.generate
--temperature 0`` on a checkpoint of shapes no preset has gives exactly transformers' greedy ids.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from confu_jax.models.llama import Llama
from confu_jax.models.unrolled import apply_unrolled, split_layers
from confu_jax.weights import CheckpointError, load_model, save_hf
from tests.helpers.tiny_checkpoints import hf_llama, hf_qwen, write_gguf, write_hf_tokenizer
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 24

CASES = {
    "qwen2_untied": dict(family="qwen2"),
    "qwen2_tied": dict(family="qwen2", tie=True),
    "qwen3_untied": dict(family="qwen3"),
    "qwen3_tied": dict(family="qwen3", tie=True),
    # Qwen3's head_dim is its own (Qwen3-8B: 32 heads x 128 = 4096 = width; Qwen3-4B: 32 x 128 = 4096 > 2560)
    "qwen3_wide_heads_mqa": dict(family="qwen3", hidden=48, heads=4, kv_heads=1, head_dim=16),
}


def _tokens(vocab, seed=1, b=2):
    return np.random.default_rng(seed).integers(0, vocab, (b, T)).astype(np.int32)


def _theirs(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _ours(cfg, params, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    scanned = Llama(cfg).apply({"params": params}, jnp.asarray(tokens), pos).logits_btv
    unrolled = jax.jit(lambda p, t: apply_unrolled(split_layers(p, cfg), cfg, t, pos).logits_btv)(params, tokens)
    return np.asarray(scanned), np.asarray(unrolled)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_logits_match_transformers(tmp_path, case):
    kw = CASES[case]
    model = hf_qwen(tmp_path, seed=sum(map(ord, case)) % 1000, **kw)
    cfg, params = load_model(str(tmp_path))
    assert (cfg.attention_bias, cfg.qk_norm) == ((True, False) if kw["family"] == "qwen2" else (False, True))
    assert cfg.tie_embeddings == kw.get("tie", False) and ("lm_head" in params) != cfg.tie_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rms_eps == 1e-6 and cfg.eos_token_ids == (0,)
    layers = params["layers"]
    if kw["family"] == "qwen2":
        assert layers["q_proj"]["bias"].shape == (cfg.n_layers, cfg.n_heads * cfg.head_dim)
        assert "bias" not in layers["o_proj"] and "q_norm" not in layers
    else:
        assert layers["q_norm"]["scale"].shape == layers["k_norm"]["scale"].shape == (cfg.n_layers, cfg.head_dim)
        assert "bias" not in layers["q_proj"]
    toks = _tokens(cfg.vocab_size)
    ref = _theirs(model, toks)
    for name, ours in zip(("scanned", "unrolled"), _ours(cfg, params, toks)):
        err = np.abs(ours - ref).max()
        assert err <= 1e-4, f"{case} {name}: max |logit diff| {err}"
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_llamacpp_layout_logits_match_transformers(tmp_path, family):
    """A Qwen GGUF as llama.cpp's converter writes one (unpermuted Q/K, ``attn_q.bias`` /
    ``attn_q_norm.weight``): our loader gives transformers' logits."""
    model = hf_qwen(tmp_path / "hf", family=family, seed=8, vocab=300, head_dim=24 if family == "qwen3" else 16)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, model, arch=family)
    cfg, params = load_model(path)
    assert (cfg.attention_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert cfg.head_dim == model.config.head_dim
    toks = _tokens(cfg.vocab_size)
    err = np.abs(_ours(cfg, params, toks)[0] - _theirs(model, toks)).max()
    assert err <= 1e-4, f"{family}: max |logit diff| {err}"


def test_sharded_bf16_checkpoint(tmp_path):
    hf_qwen(tmp_path, family="qwen3", seed=11, dtype="bfloat16", max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, params = load_model(str(tmp_path))
    assert cfg.param_dtype == "bfloat16" and params["layers"]["q_norm"]["scale"].dtype == jnp.bfloat16
    cfg32, params32 = load_model(str(tmp_path), dtype="float32")
    from transformers import Qwen3ForCausalLM

    ref = Qwen3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    toks = _tokens(cfg.vocab_size)
    assert np.abs(_ours(cfg32, params32, toks)[0] - _theirs(ref, toks)).max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_save_hf_round_trip_loads_in_transformers(tmp_path, family):
    hf_qwen(tmp_path / "src", family=family, seed=5)
    cfg, params = load_model(str(tmp_path / "src"))
    save_hf(cfg, params, str(tmp_path / "out"))
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["model_type"] == family
    import transformers

    cls = getattr(transformers, {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family])
    reloaded = cls.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    toks = _tokens(cfg.vocab_size)
    assert np.abs(_ours(cfg, params, toks)[0] - _theirs(reloaded, toks)).max() <= 1e-4
    cfg2, params2 = load_model(str(tmp_path / "out"))
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)


@pytest.mark.parametrize("family,changes,message", [
    ("qwen2", {"use_sliding_window": True}, r"use_sliding_window is true; expected false"),
    ("qwen3", {"attention_bias": True}, r"attention_bias is true for model_type 'qwen3'; expected false"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     r"layer_types has \['full_attention', 'sliding_attention'\]; expected only 'full_attention'"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
     r"rope scaling type 'yarn' is not supported"),
])
def test_unsupported_qwen_configs_are_refused_by_name(tmp_path, family, changes, message):
    hf_qwen(tmp_path, family=family, seed=2)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)


# ------------------------------------------------------------------ the CLI, greedy, against transformers

# Shapes no preset has (5 layers, width 80, 5 heads of 16 over 1 KV head; Qwen3: head_dim 24 x 4 heads
# = 96 > width 64), with the tiny chat tokenizer: vocab 300 holds its 285 tokens.
OWN = {
    "llama": dict(vocab=300, hidden=80, layers=5, heads=5, kv_heads=1, head_dim=16, ffn=144, max_pos=512),
    "qwen3": dict(family="qwen3", vocab=300, hidden=64, layers=5, heads=4, kv_heads=2, head_dim=24, ffn=112,
                  max_pos=512),
    "qwen2": dict(family="qwen2", vocab=300, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=96,
                  max_pos=512, tie=True),
}
PROMPT = "Hello world, 12345"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OWN))
def test_generate_cli_greedy_equals_transformers(tmp_path, name):
    from confu_jax.data.chat import ChatTokenizer

    kw = dict(OWN[name])
    model = (hf_qwen(tmp_path, seed=21, **kw) if kw.get("family") else hf_llama(tmp_path, seed=21, **kw))
    write_hf_tokenizer(tmp_path, generation_eos=[2, 0])  # end of turn <|im_end|> and <|endoftext|>
    tok = ChatTokenizer.load(str(tmp_path))
    assert set(tok.eos_ids) == {0, 2}
    prompt = tok.encode(tok.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    n_new = 24
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n_new, do_sample=False, eos_token_id=[0, 2], pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "launch.generate", "--model", str(tmp_path), "--prompt", PROMPT,
                        "--max_new_tokens", str(n_new), "--print_ids", "--temperature", "0",
                        "--config.chat.system="],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [int(i) for i in re.search(r"^ids: (.*)$", r.stderr, re.M).group(1).split()]
    assert got == want, (name, got, want)
    assert len(want) >= 4  # a real comparison, not two empty answers
