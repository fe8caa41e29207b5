"""EAGLE-3 heads from and to other frameworks (``weights/eagle3_formats.py``, docs/interop.md "EAGLE-3 heads from
and to other frameworks"), checked against references no one here wrote:

* ``speculators`` (vLLM's format and its own PyTorch EAGLE-3): a random head it builds and saves decodes
  here to the same draft logits as its own forward, over several TTT steps, for each norm-placement
  flag; our export loads in speculators and gives the same logits again;
* transformers' Llama modules (as tests/unit/test_draft.py): an official-format head (``midlayer.*``,
  ``pytorch_model.bin`` / bf16 safetensors, d2t offsets, a RoPE base unlike the target's) imports to
  the same logits and round-trips bit-exactly; SpecForge's ``export --to sglang`` layout (sharded,
  transformers-5 ``rope_parameters``, ``eagle_config`` layer ids) too;
* the refusals: another target's width / vocabulary / feature layers, unimplemented pieces, and a
  pickle that carries code.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from confu_jax.models.draft import init_draft_params
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.weights.eagle3_formats import bind_to_target, eagle3_part, export_head, load_head
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.tensor_files import read_tensors, save_safetensors
from tests.helpers.speculators_ref import our_ttt_logits, speculators_ttt_logits
from tests.helpers.model_fakes import DRAFT_VOCAB, tiny_params, tiny_spec
from tests.helpers.xla_env import SINGLE_DEVICE

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATOL = 1e-4  # fp32, two implementations
TARGET_THETA = 500000.0  # the target's RoPE base (Llama-3's); the draft keeps EAGLE-3's 10000
DRAFT_FFN = 96  # the draft MLP width differs from the tiny target's 128


def _target(seed=0):
    spec = tiny_spec("eagle3")
    cfg = spec.target.replace(rope_theta=TARGET_THETA)
    tp, _ = tiny_params(ModelSpec(cfg, spec.head), seed=seed)
    return cfg, tp


def _draft_vocab(v, dv, seed=0):
    rng = np.random.default_rng(seed)
    d2t = np.sort(rng.choice(v, dv, replace=False)).astype(np.int64)  # EAGLE-3 order: ascending target ids
    t2d = np.zeros((v,), bool)
    t2d[d2t] = True
    return d2t, t2d


def _inputs(cfg, n=12, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, cfg.vocab_size, (1, n)).astype(np.int32)
    h_cat = rng.normal(size=(1, n, 3 * cfg.d_model)).astype(np.float32)
    return tokens, h_cat


_ours = our_ttt_logits


# ----------------------------------------------------------------------------- speculators


def _speculators_model(cfg, embed, d2t, t2d, taps, flags, seed=0, verifier=None):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig as HFConfig

    tl = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=DRAFT_FFN,
                  num_hidden_layers=1, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)
    tl._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=len(d2t), eagle_aux_hidden_state_layer_ids=list(taps),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])),
        **flags)
    model = Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or name.startswith("fc_norm") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        model.embed_tokens.weight.copy_(torch.tensor(np.asarray(embed, np.float32)))
    model.load_vocab_mappings(torch.tensor(t2d), torch.tensor(d2t - np.arange(len(d2t))))
    return model.eval()


_speculators_logits = speculators_ttt_logits


FLAG_SETS = [{}, {"norm_before_residual": True, "norm_output": True}, {"norm_before_fc": True}, {"fc_norm": True},
             {"fc_norm": True, "norm_output": True}]  # the last: EAGLE 3.1 (configs/smollm2_eagle31.py)


@pytest.mark.slow
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "plain")
def test_speculators_head_imports_to_the_same_logits(tmp_path, flags):
    pytest.importorskip("speculators")
    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    taps = (1, 4, 6)
    model = _speculators_model(cfg, embed, d2t, t2d, taps, flags)
    model.save_pretrained(str(tmp_path))
    imp = load_head(str(tmp_path))
    assert imp.fmt == "speculators"
    spec, trainable, vocab = bind_to_target(imp, cfg, tp)
    assert spec.taps == taps and spec.draft_ffn_dim == DRAFT_FFN
    assert spec.draft_rope.rope_theta == 10000.0 != cfg.rope_theta  # the draft's own RoPE base
    assert all(getattr(spec.head, k) == v for k, v in flags.items())
    np.testing.assert_array_equal(vocab["d2t"], d2t)  # offsets on disk -> absolute ids here
    np.testing.assert_array_equal(vocab["t2d"], t2d)
    tokens, h_cat = _inputs(cfg)
    steps = 4
    ref = _speculators_logits(model, tokens, h_cat, steps)
    ours = _ours(spec, trainable["draft"], embed, tokens, h_cat, steps)
    n = tokens.shape[1]
    for r in range(steps):  # positions whose step-r token is real (later ones read padding, as in training)
        np.testing.assert_allclose(ours[r, :n - 1 - r], ref[r, :n - 1 - r], atol=ATOL, rtol=1e-4, err_msg=f"step {r}")


def _our_head(cfg, seed=3, **head_kw):
    head = HeadConfig(variant="eagle3", draft_vocab_size=DRAFT_VOCAB, draft_ffn_dim=DRAFT_FFN, init_std=0.15,
                      rope_theta=10000.0, max_position_embeddings=2048, rms_eps=1e-6, **head_kw)
    spec = ModelSpec(cfg, head)
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_draft_params(spec, jax.random.PRNGKey(0)))
    draft = jax.tree_util.tree_map_with_path(
        lambda p, x: (1.0 + 0.1 * rng.standard_normal(x.shape) if p[-1].key == "scale"
                      else 0.15 * rng.standard_normal(x.shape)).astype(np.float32), shapes)
    return spec, draft


def _hf_target_dir(cfg, tp, path):
    from confu_jax.weights import save_hf

    save_hf(cfg, tp, str(path))
    return str(path)


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "fc_norm": True},
                                   {"fc_norm": True, "norm_output": True}], ids=["plain", "flags", "eagle31"])
def test_our_export_loads_in_speculators_with_the_same_logits(tmp_path, flags, monkeypatch):
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    spec, draft = _our_head(cfg, tap_layers=(2, 3, 5), **flags)
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=5)
    verifier = _hf_target_dir(cfg, tp, tmp_path / "target")
    # with the target's embedding, as speculators saves its own heads (its loader does not fill a
    # missing one from the verifier under transformers 5)
    out = export_head(str(tmp_path / "head"), "speculators", spec, draft, d2t, t2d, verifier=verifier, embed=embed)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the verifier is a local directory: never the hub
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs its block sizes
    model = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    np.testing.assert_array_equal(model.embed_tokens.weight.detach().numpy(), embed)
    np.testing.assert_array_equal(model.d2t.numpy() + np.arange(DRAFT_VOCAB), d2t)
    np.testing.assert_array_equal(model.t2d.numpy(), t2d)
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == [2, 3, 5]
    tokens, h_cat = _inputs(cfg, seed=7)
    steps = 3
    ref = _speculators_logits(model, tokens, h_cat, steps)
    ours = _ours(spec, draft, embed, tokens, h_cat, steps)
    n = tokens.shape[1]
    for r in range(steps):
        np.testing.assert_allclose(ours[r, :n - 1 - r], ref[r, :n - 1 - r], atol=ATOL, rtol=1e-4, err_msg=f"step {r}")
    # and back: the export re-imports to the same parameters, bit for bit
    spec2, tr2, vocab2 = bind_to_target(load_head(out), cfg, tp)
    assert spec2.head == dataclasses.replace(spec.head, init_std=spec2.head.init_std)
    jax.tree_util.tree_map(np.testing.assert_array_equal, tr2["draft"], draft)
    np.testing.assert_array_equal(vocab2["d2t"], d2t)


# ----------------------------------------------------------------------------- official format


def _official_torch_head(cfg, d2t, t2d, theta, seed=0, round_bf16=False):
    """An official-format EAGLE-3 state dict and config, built from transformers' Llama modules (q/k/v
    widened to 2d as in EAGLE-3's cnets.py), and a function computing its step-0 logits."""
    from transformers import LlamaConfig as HFConfig
    from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)

    d = cfg.d_model
    hf = HFConfig(hidden_size=d, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, intermediate_size=DRAFT_FFN, rope_theta=theta, rms_norm_eps=1e-5,
                  attention_bias=False, mlp_bias=False)
    hf._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = LlamaAttention(hf, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * d, getattr(attn, name).out_features, bias=False))
    mlp = LlamaMLP(hf)
    norms = {k: LlamaRMSNorm(d, eps=1e-5) for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                                     "norm")}
    fc = torch.nn.Linear(3 * d, d, bias=False)
    lm_head = torch.nn.Linear(d, len(d2t), bias=False)
    with torch.no_grad():
        for m in [attn, mlp, fc, lm_head]:
            for p in m.parameters():
                p.copy_(0.15 * torch.randn(p.shape))
        for n_ in norms.values():
            n_.weight.copy_(1.0 + 0.1 * torch.randn(d))
        if round_bf16:  # the modules compute with exactly what a bf16 file holds
            for m in [attn, mlp, fc, lm_head, *norms.values()]:
                for p in m.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
    sd = {f"midlayer.self_attn.{k}.weight": getattr(attn, k).weight for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
    sd.update({f"midlayer.mlp.{k}.weight": getattr(mlp, k).weight for k in ("gate_proj", "up_proj", "down_proj")})
    sd.update({f"midlayer.{k}.weight": norms[k].weight for k in ("input_layernorm", "hidden_norm",
                                                                  "post_attention_layernorm")})
    sd.update({"fc.weight": fc.weight, "norm.weight": norms["norm"].weight, "lm_head.weight": lm_head.weight,
               "d2t": torch.tensor(d2t - np.arange(len(d2t))), "t2d": torch.tensor(t2d)})
    sd = {k: v.detach().clone() for k, v in sd.items()}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": DRAFT_FFN, "num_attention_heads": cfg.n_heads, "num_hidden_layers": 1,
              "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "vocab_size": cfg.vocab_size,
              "draft_vocab_size": len(d2t), "torch_dtype": "float32", "tie_word_embeddings": False}
    if theta != 10000.0:
        config["rope_theta"] = theta
    rope = LlamaRotaryEmbedding(hf)

    def logits(embed, tokens, h_cat):
        n = tokens.shape[1]
        with torch.no_grad():
            e = torch.tensor(np.asarray(embed)[np.concatenate([tokens[0, 1:], [0]])])[None]
            h = fc(torch.tensor(h_cat))
            x = torch.cat([norms["input_layernorm"](e), norms["hidden_norm"](h)], -1)
            cos_sin = rope(x, torch.arange(n)[None])
            mask = torch.where(torch.tril(torch.ones(n, n, dtype=torch.bool)), 0.0, torch.finfo(torch.float32).min)
            a, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask[None, None])
            h = h + a
            h = h + mlp(norms["post_attention_layernorm"](h))
            return lm_head(norms["norm"](h))[0].numpy()

    return sd, config, logits


def _write_official(path, sd, config, kind):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if kind == "bin":
        torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    else:  # bf16 safetensors, as published heads often are
        t = {k: (v.to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.is_floating_point()
                 else v.numpy()) for k, v in sd.items()}
        save_safetensors(t, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("kind", ["bin", "bf16"])
def test_official_head_imports_bit_exactly_and_round_trips(tmp_path, kind):
    cfg, tp = _target()
    embed = np.asarray(tp["embed"]["embedding"])
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=2)
    # no rope_theta in config.json: EAGLE-3's default base 10000, not the target's 500000
    sd, config, ref_logits = _official_torch_head(cfg, d2t, t2d, theta=10000.0, round_bf16=kind == "bf16")
    src = _write_official(tmp_path / "official", sd, config, kind)
    imp = load_head(src)
    assert imp.fmt == "eagle3" and imp.head.rope_theta == 10000.0 and imp.head.max_position_embeddings == 2048
    assert imp.stored_dtype == ("float32" if kind == "bin" else "bfloat16")
    spec, trainable, vocab = bind_to_target(imp, cfg, tp)
    assert spec.taps == cfg.default_taps  # the residual streams entering layers 2, L//2, L-3
    dp = trainable["draft"]
    np.testing.assert_array_equal(dp["q_proj"]["kernel"], sd["midlayer.self_attn.q_proj.weight"].float().numpy().T)
    np.testing.assert_array_equal(dp["final_norm"]["scale"], sd["norm.weight"].float().numpy())
    np.testing.assert_array_equal(vocab["d2t"], d2t)
    tokens, h_cat = _inputs(cfg)
    ours = _ours(spec, dp, embed, tokens, h_cat, 1)[0]
    ref = ref_logits(embed, tokens, h_cat)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=1e-4)
    wrong_base = ModelSpec(cfg, dataclasses.replace(spec.head, rope_theta=None))  # the target's 500000
    assert np.abs(_ours(wrong_base, dp, embed, tokens, h_cat, 1)[0] - ref).max() > 1e-3  # the test would see it
    # round trip: export in the official format, in the file's dtype -> the same tensors, bit for bit
    out = export_head(str(tmp_path / "again"), "eagle3", spec, dp, vocab["d2t"], vocab["t2d"],
                      dtype=imp.stored_dtype)
    a, b = read_tensors(src), read_tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=k)
        assert np.asarray(b[k]).dtype == np.asarray(a[k]).dtype, k
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["rope_theta"] == 10000.0 and written["draft_vocab_size"] == DRAFT_VOCAB
    assert "eagle_config" not in written  # default taps: SGLang's own default
    spec3, tr3, _ = bind_to_target(load_head(out), cfg, tp)
    assert spec3 == spec


def test_specforge_sglang_export_layout(tmp_path):
    """SpecForge's ``export --to sglang``: save_pretrained of the official module names in bf16, possibly
    sharded, transformers-5 ``rope_parameters`` (+ legacy ``rope_scaling``), ``dtype``, and SGLang's
    ``eagle_config`` layer ids (layer outputs: entering layer id + 1)."""
    cfg, tp = _target()
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=4)
    sd, config, _ = _official_torch_head(cfg, d2t, t2d, theta=10000.0, seed=1)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config.pop("torch_dtype")
    config.update({"dtype": "bfloat16", "rope_parameters": {**scaling, "rope_theta": 500000.0},
                   "rope_scaling": scaling, "rope_theta": 500000.0,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 4]}})
    path = tmp_path / "specforge"
    os.makedirs(path)
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    t = {k: (v.to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.is_floating_point()
             else v.numpy()) for k, v in sd.items()}
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_safetensors({k: t[k] for k in keys}, str(path / shard))
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    imp = load_head(str(path))
    assert imp.fmt == "eagle3" and imp.stored_dtype == "bfloat16"
    assert imp.head.tap_layers == (1, 4, 5)
    assert imp.head.rope_theta == 500000.0 and imp.head.rope_scaling == (8.0, 1.0, 4.0, 64)
    spec, tr, vocab = bind_to_target(imp, cfg, tp)
    for k in t:
        if k.startswith("midlayer.self_attn.q_proj"):
            np.testing.assert_array_equal(tr["draft"]["q_proj"]["kernel"], t[k].astype(np.float32).T)
    np.testing.assert_array_equal(vocab["d2t"], d2t)
    out = export_head(str(tmp_path / "out"), "eagle3", spec, tr["draft"], vocab["d2t"], vocab["t2d"], dtype="bfloat16")
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 4]
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_parameters"]["rope_theta"] == 500000.0
    back = read_tensors(out)
    for k in t:
        np.testing.assert_array_equal(np.asarray(back[k]), t[k], err_msg=k)
    assert bind_to_target(load_head(out), cfg, tp)[0] == spec


# ----------------------------------------------------------------------------- refusals


def _exported(tmp_path, cfg, fmt="speculators", **head_kw):
    spec, draft = _our_head(cfg, **head_kw)
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    return export_head(str(tmp_path / fmt), fmt, spec, draft, d2t, t2d)


def test_heads_for_another_target_are_refused(tmp_path):
    cfg, tp = _target()
    imp = load_head(_exported(tmp_path, cfg, tap_layers=(2, 4, 7)))
    with pytest.raises(CheckpointError, match=r"hidden_size is 64; the target has 32"):
        bind_to_target(imp, cfg.replace(d_model=32), None)
    with pytest.raises(CheckpointError, match=r"vocab_size is 128; the target has 256"):
        bind_to_target(imp, cfg.replace(vocab_size=256), None)
    with pytest.raises(CheckpointError, match=r"feature layers \[2, 4, 7\].*eagle_aux_hidden_state_layer_ids.*\[0, 6\)"):
        bind_to_target(imp, cfg.replace(n_layers=6), None)
    other_embed = {"embed": {"embedding": np.asarray(tp["embed"]["embedding"]) + 1e-2}}
    path = tmp_path / "with_embed"
    spec, draft = _our_head(cfg)
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    export_head(str(path), "speculators", spec, draft, d2t, t2d, embed=np.asarray(tp["embed"]["embedding"]))
    bind_to_target(load_head(str(path)), cfg, tp)  # its own target's embedding: accepted
    with pytest.raises(CheckpointError, match="embed_tokens.weight differs"):
        bind_to_target(load_head(str(path)), cfg, other_embed)


def _edit_config(path, **kw):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        c = json.load(f)
    for k, v in kw.items():
        node, *rest = k.split("__")
        if rest:
            c[node][rest[0]] = v
        else:
            c[k] = v
    with open(p, "w") as f:
        json.dump(c, f)


def test_unimplemented_pieces_are_refused_by_name(tmp_path):
    cfg, _ = _target()
    src = _exported(tmp_path, cfg)
    _edit_config(src, transformer_layer_config__model_type="qwen3")
    with pytest.raises(CheckpointError, match=r"model_type 'qwen3'; expected 'llama'"):
        load_head(src)
    _edit_config(src, transformer_layer_config__model_type="llama", transformer_layer_config__num_hidden_layers=2)
    with pytest.raises(CheckpointError, match="num_hidden_layers is 2; expected 1"):
        load_head(src)
    _edit_config(src, transformer_layer_config__num_hidden_layers=1, transformer_layer_config__attention_bias=True)
    with pytest.raises(CheckpointError, match="attention_bias is true"):
        load_head(src)
    _edit_config(src, transformer_layer_config__attention_bias=False)
    tensors = {k: np.array(v) for k, v in read_tensors(src).items()}
    tensors["layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_safetensors(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_norm\.weight.*not part of the EAGLE-3 draft"):
        load_head(src)
    del tensors["layers.0.self_attn.q_norm.weight"], tensors["fc.weight"]
    save_safetensors(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' missing"):
        load_head(src)
    # the official format cannot carry norm-placement flags: exporting such a head there is refused
    spec, draft = _our_head(cfg, norm_output=True)
    with pytest.raises(ValueError, match="norm_output"):
        export_head(str(tmp_path / "x"), "eagle3", spec, draft, np.arange(DRAFT_VOCAB), np.arange(128) < DRAFT_VOCAB)


class _Payload:
    """Unpickling this would create a file: the loader must refuse before calling anything."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_carries_code_is_refused(tmp_path):
    cfg, _ = _target()
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    sd, config, _ = _official_torch_head(cfg, d2t, t2d, theta=10000.0)
    marker = tmp_path / "pwned"
    src = tmp_path / "evil"
    _write_official(src, sd, config, "bin")
    torch.save({**sd, "extra": _Payload(str(marker))}, str(src / "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: refused: the pickle names code"):
        load_head(str(src))
    assert not marker.exists()


# ----------------------------------------------------------------------------- ConFu, decoding, init_from


def test_confu_head_exports_its_eagle3_part(tmp_path):
    cfg, tp = _target()
    spec = ModelSpec(cfg, HeadConfig(variant="confu", draft_vocab_size=DRAFT_VOCAB, n_soft_prompts=2, n_expert=2))
    _, trainable = tiny_params(spec, seed=2)
    e_spec, e_draft = eagle3_part(spec, jax.device_get(trainable))
    assert e_spec.head.variant == "eagle3" and "moe_f" not in e_draft
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB)
    out = export_head(str(tmp_path / "e3"), "eagle3", e_spec, e_draft, d2t, t2d)
    spec2, tr2, _ = bind_to_target(load_head(out), cfg, tp)
    # the target's RoPE (this head was trained with it) is written out and read back explicitly
    assert spec2.draft_rope.rope_theta == cfg.rope_theta
    tokens, h_cat = _inputs(cfg)
    embed = np.asarray(tp["embed"]["embedding"])
    np.testing.assert_array_equal(_ours(spec2, tr2["draft"], embed, tokens, h_cat, 2),
                                  _ours(e_spec, e_draft, embed, tokens, h_cat, 2))


def test_init_from_an_imported_head(tmp_path):
    from confu_jax.models.params import init_trainable
    from confu_jax.runs.checkpoint import init_params_from

    cfg, tp = _target()
    src = _exported(tmp_path, cfg)
    imp = load_head(src)
    confu = ModelSpec(cfg, dataclasses.replace(imp.head, variant="confu", n_soft_prompts=2, n_expert=2))
    fresh = init_trainable(confu, jax.random.PRNGKey(0))
    # a different draft vocabulary: the LM head is moved by target id
    d2t_run = np.sort(np.random.default_rng(9).choice(cfg.vocab_size, DRAFT_VOCAB, replace=False))
    params, report = init_params_from(src, fresh, draft_vocab_d2t=d2t_run, model_spec=confu)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.testing.assert_array_equal(np.asarray(params["draft"]["fc"]["kernel"]), imp.draft["fc"]["kernel"])
    assert any("moe_f" in p for p in report.kept_init) and any("soft_prompt" in p for p in report.kept_init)
    col = {int(t): j for j, t in enumerate(imp.d2t)}
    for i, t in enumerate(d2t_run):
        if int(t) in col:
            np.testing.assert_array_equal(np.asarray(params["draft"]["lm_head"]["kernel"])[:, i],
                                          imp.draft["lm_head"]["kernel"][:, col[int(t)]])
    assert report.lm_head_remap["matched"] == len(set(col) & set(int(t) for t in d2t_run))
    assert flat  # the tree keeps its structure
    # a run with the target's RoPE would compute something else with these weights: refused by config key
    with pytest.raises(ValueError, match=r"draft\.rope_theta: head has 10000.0, this run 500000.0"):
        init_params_from(src, fresh, model_spec=ModelSpec(cfg, dataclasses.replace(confu.head, rope_theta=None)))


@pytest.mark.slow
def test_generate_cli_decodes_with_an_imported_head(tmp_path_factory):
    """``launch.generate --draft_ckpt DIR`` with a speculators-format head: lossless (greedy == AR)."""
    from confu_jax.weights import load_model
    from tests.helpers.tiny_chat_model import tiny_chat_gguf

    gguf = tiny_chat_gguf(tmp_path_factory.mktemp("tiny"))
    cfg, _ = load_model(gguf)
    head_dir = tmp_path_factory.mktemp("head")
    spec = ModelSpec(cfg, HeadConfig(variant="eagle3", draft_vocab_size=cfg.vocab_size // 2, rope_theta=10000.0,
                                     init_std=0.05))
    draft = jax.device_get(init_draft_params(spec, jax.random.PRNGKey(1)))
    d2t = np.arange(cfg.vocab_size // 2)
    export_head(str(head_dir), "speculators", spec, draft, d2t, np.arange(cfg.vocab_size) < cfg.vocab_size // 2)
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    ids = {}
    for method in (["--method", "ar"], ["--method", "eagle3", "--draft_ckpt", str(head_dir), "--tree", "chain:3"]):
        r = subprocess.run([sys.executable, "-m", "launch.generate", "--model", gguf, "--prompt", "Hello world",
                            "--max_new_tokens", "12", "--print_ids", "--temperature", "0", *method],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "UNTRAINED" not in r.stderr
        ids[method[1]] = re.search(r"^ids: (.*)$", r.stderr, re.M).group(1).split()
    assert ids["eagle3"] == ids["ar"] and len(ids["ar"]) >= 2


@pytest.mark.slow
def test_export_head_cli_on_a_confu_workdir(tmp_path):
    """``python -m launch.export_head`` on a trained ConFu run: the warning, and the EAGLE-3 part in
    both formats re-imports to the run's own parameters, bit for bit."""
    from configs.tiny import get_config
    from confu_jax.runs.heads import load_trained_head
    from confu_jax.train.loop import train

    workdir = str(tmp_path / "confu")
    config = get_config("confu")
    config.train.steps = 1
    config.train.eval_every = 0
    config.train.checkpoint.every = 1
    config.train.checkpoint.async_save = False
    config.train.progress_bar = False
    config.train.tensorboard = "off"
    train(config, workdir)
    head = load_trained_head(workdir)
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    for fmt in ("eagle3", "speculators"):
        out = str(tmp_path / fmt)
        r = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", workdir, "--format", fmt,
                            "--out", out], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "no contemplate tokens" in r.stderr
        imp = load_head(out)
        assert imp.fmt == fmt
        spec, tr, vocab = bind_to_target(imp, head.spec.target, None)
        assert spec.taps == head.spec.taps and spec.draft_rope.rope_theta == head.spec.target.rope_theta
        want = {k: v for k, v in head.trainable["draft"].items() if k != "moe_f"}
        jax.tree_util.tree_map(np.testing.assert_array_equal, tr["draft"], want)
        np.testing.assert_array_equal(vocab["d2t"], head.draft_vocab["d2t"])
        np.testing.assert_array_equal(vocab["t2d"], head.draft_vocab["t2d"])


@pytest.mark.slow
def test_confu_training_starts_from_an_imported_head(tmp_path):
    """``train.checkpoint.init_from=<EAGLE-3 head dir>`` through the train loop: the draft starts at
    the head's weights when the run's draft settings are the head's, and is refused (naming the
    config key) when they are not."""
    from configs.tiny import get_config
    from confu_jax.train.loop import train

    def config_for(**draft):
        c = get_config("confu")
        c.train.steps = 1
        c.train.eval_every = 0
        c.train.checkpoint.every = 1
        c.train.checkpoint.async_save = False
        c.train.progress_bar = False
        c.train.tensorboard = "off"
        for k, v in draft.items():
            c.draft[k] = v
        return c

    from confu_jax.models.spec import model_spec_from_config

    target_cfg = model_spec_from_config(config_for()).target
    src = _exported(tmp_path, target_cfg)  # rope_theta 10000, rms_eps 1e-6, ffn 96
    with pytest.raises(ValueError, match=r"draft\.rms_eps: head has 1e-06, this run 1e-05"):
        c = config_for()
        c.train.checkpoint.init_from = src
        train(c, str(tmp_path / "refused"))
    c = config_for(rms_eps=1e-6, rope_theta=10000.0, ffn_dim=DRAFT_FFN)
    c.train.checkpoint.init_from = src
    train(c, str(tmp_path / "run"))
    with open(tmp_path / "run" / "init_from.json") as f:
        report = json.load(f)
    assert "draft/fc/kernel" in report["copied"] and "draft/q_proj/kernel" in report["copied"]
    assert not report["shape_mismatch"]
    assert all("moe" in p or "soft_prompt" in p for p in report["kept_init"])


@pytest.mark.parametrize("fmt", ["eagle3", "speculators", "tpu_inference"])
def test_a_whole_vocabulary_head_writes_no_maps_and_reads_back_the_identity(tmp_path, fmt):
    """vLLM's Eagle3LlamaForCausalLM has a draft_id_to_target_id parameter only when draft_vocab_size differs from
    the target's vocabulary, and refuses a d2t tensor otherwise (as it did our P-EAGLE export): a head over the
    whole vocabulary is written without d2t / t2d and reads back with the identity maps; a reduced one keeps both."""
    cfg, tp = _target()
    full = ModelSpec(cfg, dataclasses.replace(tiny_spec("eagle3").head, draft_vocab_size=cfg.vocab_size))
    dp = jax.device_get(init_draft_params(full, jax.random.PRNGKey(3)))
    ident = np.arange(cfg.vocab_size)
    out = export_head(str(tmp_path / "full"), fmt, full, dp, ident, np.ones(cfg.vocab_size, bool))
    assert not {"d2t", "t2d"} & set(read_tensors(out))
    spec, trainable, vocab = bind_to_target(load_head(out), cfg, tp)
    np.testing.assert_array_equal(vocab["d2t"], ident)
    assert vocab["t2d"].all() and spec.head.draft_vocab_size == cfg.vocab_size
    # a permutation of the whole vocabulary is not the identity: its maps are written
    perm = ident[::-1].copy()
    out = export_head(str(tmp_path / "perm"), fmt, full, dp, perm, np.ones(cfg.vocab_size, bool))
    assert {"d2t", "t2d"} <= set(read_tensors(out))
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=2)
    reduced = tiny_spec("eagle3")
    out = export_head(str(tmp_path / "reduced"), fmt, ModelSpec(cfg, reduced.head),
                      jax.device_get(init_draft_params(ModelSpec(cfg, reduced.head), jax.random.PRNGKey(4))), d2t, t2d)
    np.testing.assert_array_equal(np.asarray(read_tensors(out)["d2t"]), d2t - np.arange(DRAFT_VOCAB))


def test_tpu_inference_layout_round_trips_and_refuses_what_it_would_run_wrongly(tmp_path):
    """``--format tpu_inference``: the official tensors under the architecture tpu-inference's registry maps to its
    JAX model, with the one norm flag that model reads; heads it would run wrongly are refused, each naming why
    (its loader and forward on a real export: tests/e2e/test_tpu_inference.py)."""
    cfg, tp = _target()
    spec, draft = _our_head(cfg, norm_before_residual=True)
    d2t, t2d = _draft_vocab(cfg.vocab_size, DRAFT_VOCAB, seed=6)
    out = export_head(str(tmp_path / "tpu"), "tpu_inference", spec, draft, d2t, t2d)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["Eagle3LlamaForCausalLM"] and c["norm_before_residual"] is True
    assert c["rope_theta"] == 10000.0 and c["draft_vocab_size"] == DRAFT_VOCAB  # its default theta would be 500000
    assert any(k.startswith("midlayer.") for k in read_tensors(out))
    imp = load_head(out)
    assert imp.fmt == "tpu_inference"
    spec2, tr2, vocab2 = bind_to_target(imp, cfg, tp)
    assert spec2.head.norm_before_residual and spec2.taps == cfg.default_taps
    jax.tree_util.tree_map(np.testing.assert_array_equal, tr2["draft"], draft)
    np.testing.assert_array_equal(vocab2["d2t"], d2t)
    for kw, why in (({"fc_norm": True, "norm_output": True}, r"norm_before_residual only.*fc_norm"),
                    ({"tap_layers": (2, 3, 5)}, r"entering layers \[2, 4, 5\].*trained on \[2, 3, 5\]")):
        s_bad, d_bad = _our_head(cfg, **kw)
        with pytest.raises(ValueError, match=why):
            export_head(str(tmp_path / "bad"), "tpu_inference", s_bad, d_bad, d2t, t2d)
    qwen3 = ModelSpec(cfg.replace(qk_norm=True), spec.head)
    with pytest.raises(ValueError, match=r"Llama model only.*qwen3 target"):
        export_head(str(tmp_path / "bad"), "tpu_inference", qwen3, draft, d2t, t2d)
