"""DeepSeek-V3's MTP module (``models.mtp``, ``decode.mtp``, ``train.mtp_task``, ``weights.mtp_format``,
``runs.mtp``).

Forward parity is checked against torch: the reference block is transformers' ``LlamaDecoderLayer``
(the target's layer configuration) inside a transcription of SGLang's ``DeepseekModelNextN.forward``
(``python/sglang/srt/models/deepseek_nextn.py``; vLLM's ``DeepSeekMultiTokenPredictorLayer`` is the
same but for zeroing the embedding at position 0): eh_proj(cat(enorm(emb), hnorm(h))) -> decoder layer
-> shared_head.norm -> the target's LM head. The torch module subclasses ``LlamaDecoderLayer`` and adds
enorm / hnorm / eh_proj / shared_head.norm, so its state dict keys are exactly DeepSeek-V3's
layer-relative MTP names: our export loads into it with strict=True.

(1) forward (sequence form, decode form against a cache) and initialisation; (2) the drafts are the
recursion on the module's own output (chain; a tree's children differ per parent); in the loop, greedy
output equals AR (chain, static tree, dynamic tree; two prompts of different lengths, EOS inside a
draft), sampled output passes the chi-square test at T=1 against the exact joint (sampled chain, static
tree; greedy = AR for every plan shape and sharded = single device: tests/contract/test_family_contract.py); (3) the DeepSeek-layout round trip (bf16, shared embedding / LM head
checked against the target, a file holding the main model's layers too) and decoding from it; (4) the
loss equals a hand computation with the torch reference, packed rows equal padded rows, a short run
lowers it and loads for decoding, and a killed run resumes with identical losses and exports through
``launch.export_head --format mtp`` (subprocess).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.mtp import MTPDrafter, parse_mtp_plan
from confu_jax.models import mtp as mtp_lib
from confu_jax.models.kv_cache import commit, init_cache
from confu_jax.decode.families import get_method
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import generated_rows, make, own

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]
# the module's pieces under jit (tests/helpers/jitting.py: called eagerly, every primitive compiles on its own)
init_mtp, mtp_sequence, mtp_logits, mtp_block = (
    jit_static(f) for f in (mtp_lib.init_mtp, mtp_lib.mtp_sequence, mtp_lib.mtp_logits, mtp_lib.mtp_block))


def module_for(cfg, tp, seed=0, eh_std=0.3, init_block="random"):
    """An MTP module with every term acting: norm scales and the block perturbed, eh_proj large."""
    m = jax.tree_util.tree_map(np.array, init_mtp(jax.random.PRNGKey(seed), cfg, tp, init_block=init_block,
                                                  init_std=0.2))
    rng = np.random.default_rng(seed + 1)
    for path in ("enorm", "hnorm", "shared_head/norm", "block/attn_norm", "block/mlp_norm"):
        node = m
        for p in path.split("/"):
            node = node[p]
        node["scale"] = (1 + 0.3 * rng.standard_normal(node["scale"].shape)).astype(np.float32)
    m["eh_proj"]["kernel"] = (eh_std * rng.standard_normal(m["eh_proj"]["kernel"].shape)).astype(np.float32)
    return m


def setup(vocab, seed=0, **kw):
    spec, tp, _ = make("eagle3", vocab, seed=seed, **kw)
    m = module_for(spec.target, tp, seed=seed)
    return spec, tp, own(spec, tp, {"mtp": m})


# ----------------------------------------------------------------------------- the reference


def _torch_reference(cfg, sd_layer, embed_vd):
    """SGLang's DeepseekModelNextN with a Llama block (transformers' LlamaDecoderLayer), float64, loaded
    from the layer-relative DeepSeek-V3 names with strict=True."""
    import torch
    import torch.nn as nn
    from transformers import LlamaConfig as HFConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta, num_hidden_layers=1,
                  max_position_embeddings=cfg.max_position_embeddings, attention_bias=False, mlp_bias=False)
    hf._attn_implementation = "eager"

    class MTPLayer(LlamaDecoderLayer):
        def __init__(self):
            super().__init__(hf, 0)
            d = hf.hidden_size
            self.enorm = LlamaRMSNorm(d, eps=hf.rms_norm_eps)
            self.hnorm = LlamaRMSNorm(d, eps=hf.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = LlamaRMSNorm(d, eps=hf.rms_norm_eps)
            self.rotary = LlamaRotaryEmbedding(hf)

        def mtp(self, tokens, hidden, positions):
            """-> (h' pre-norm, logits)"""
            emb = torch.from_numpy(np.asarray(embed_vd, np.float64))[tokens]
            x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))
            t = x.shape[1]
            mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)[None, None]
            pe = self.rotary(x, positions)
            out = LlamaDecoderLayer.forward(self, x, attention_mask=mask, position_ids=positions,
                                            position_embeddings=pe)
            logits = self.shared_head.norm(out) @ torch.from_numpy(np.asarray(embed_vd, np.float64)).T  # tied head
            return out, logits

    ref = MTPLayer().double()
    ref.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in sd_layer.items()}, strict=True)
    return ref


def test_forward_equals_reference():
    import torch

    spec, tp, params = setup(24)
    cfg, m = spec.target, params.drafter_params.weights["mtp"]
    n = cfg.n_layers
    sd = mtp_lib.to_reference_state_dict(m, n)
    assert all(k.startswith(f"model.layers.{n}.") for k in sd)
    ref = _torch_reference(cfg, {k[len(f"model.layers.{n}."):]: v for k, v in sd.items()}, tp["embed"]["embedding"])
    rng = np.random.default_rng(3)
    b, t = 2, 7
    tokens = rng.integers(0, 24, (b, t))
    hidden = (2 * rng.standard_normal((b, t, cfg.d_model))).astype(np.float32)
    pos = np.broadcast_to(np.arange(t) + 3, (b, t))  # RoPE offset: positions matter
    with torch.no_grad():
        want_h, want_logits = (x.numpy() for x in ref.mtp(torch.from_numpy(tokens), torch.from_numpy(hidden).double(),
                                                          torch.from_numpy(np.ascontiguousarray(pos))))
    h = mtp_sequence(m, cfg, tp, jnp.asarray(tokens), jnp.asarray(hidden), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(mtp_logits(m, cfg, tp, h)), want_logits, rtol=2e-4, atol=2e-4)
    assert np.abs(want_logits).std() > 0.1  # not a vanishing comparison
    # the decode form: the first 4 entries committed to a one-layer cache, the last 3 as a causal block
    out = mtp_block(m, cfg, tp, jnp.asarray(tokens), jnp.asarray(hidden), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(out.h_out_btd), want_h, rtol=2e-4, atol=2e-4)
    cache = init_cache(1, b, 16, cfg.n_kv_heads, cfg.head_dim)
    cache = jit_static(commit)(cache, out.k_new_bthd[None, :, :4], out.v_new_bthd[None, :, :4], jnp.full((b,), 4))
    tail = mtp_block(m, cfg, tp, jnp.asarray(tokens[:, 4:]), jnp.asarray(hidden[:, 4:]),
                     jnp.asarray(pos[:, 4:]), cache=cache, logits_index_b=jnp.array([2, 1]))
    np.testing.assert_allclose(np.asarray(tail.h_out_btd), want_h[:, 4:], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(tail.logits_btv)[:, 0], want_logits[[0, 1], [6, 5]], rtol=2e-4, atol=2e-4)
    # names round trip; the shapes are the target's layer's
    back, idx, shared = mtp_lib.from_reference_state_dict(sd, cfg)
    assert idx == n and shared == {}
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, m)
    mtp_lib.check_mtp_params(m, cfg)
    with pytest.raises(ValueError, match="missing keys"):
        mtp_lib.from_reference_state_dict({k: v for k, v in sd.items() if "hnorm" not in k}, cfg)
    with pytest.raises(ValueError, match="expected shape"):
        mtp_lib.from_reference_state_dict(sd, cfg.replace(ffn_dim=cfg.ffn_dim * 2))


def test_initialisation():
    spec, tp, _ = make("eagle3", 24)
    cfg = spec.target
    m = init_mtp(jax.random.PRNGKey(0), cfg, tp)
    mtp_lib.check_mtp_params(m, cfg)
    # the block starts as the target's last decoder layer, shared_head.norm as its final norm
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b[-1]), m["block"], dict(tp["layers"]))
    np.testing.assert_array_equal(m["shared_head"]["norm"]["scale"], tp["final_norm"]["scale"])
    np.testing.assert_array_equal(m["enorm"]["scale"], 1)
    assert np.std(np.asarray(m["eh_proj"]["kernel"])) == pytest.approx(0.02, rel=0.1)
    r = init_mtp(jax.random.PRNGKey(0), cfg, tp, init_block="random")
    assert not np.array_equal(r["block"]["q_proj"]["kernel"], tp["layers"]["q_proj"]["kernel"][-1])
    np.testing.assert_array_equal(r["block"]["attn_norm"]["scale"], 1)
    shapes = jax.tree_util.tree_map(lambda x: x.shape, mtp_lib.trainable_shapes(cfg))
    assert shapes == jax.tree_util.tree_map(lambda x: x.shape, r)


def test_plan_parsing():
    d = parse_drafter("mtp", "tree:2,2,1")
    assert isinstance(d, MTPDrafter) and d.n_nodes == 1 + 2 + 4 + 4 and d.max_depth == 3
    assert d.describe() == "tree:2,2,1" and d.rule(True).name == "greedy"
    assert parse_drafter("mtp", "chain:5").plan.k == 5  # one module, any depth
    assert parse_drafter("mtp", "sampled_chain:2").rule(False).name == "sampled_chain"
    assert parse_drafter("mtp", "dynamic:3,2,5").n_nodes == 1 + 5
    with pytest.raises(ValueError, match="contemplates"):
        parse_mtp_plan("chain:3+c2")
    from confu_jax.bench import budget, cli_args

    assert "mtp" in cli_args.plan_families("tree:2,2") and "mtp" in cli_args.plan_families("dynamic:3,2,4")
    chains, trees = budget.default_candidates("mtp")
    for p in chains + trees:
        parse_drafter("mtp", p)
    assert get_method("mtp").needs_head and get_method("mtp").speculative
    spec, tp, _ = make("eagle3", 6)
    with pytest.raises(ValueError, match="needs drafter_params.weights\\['mtp'\\]"):
        empty = own(spec, tp, {})
        loop.generate_speculative(empty.target, parse_drafter("mtp", "chain:2"), empty.drafter_params, PROMPTS,
                                  max_new_tokens=4, eos_ids=())


# ----------------------------------------------------------------------------- in the loop


def _first_proposal(spec, tp, params, plan, prompt):
    """init + propose after the target's prefill of one prompt -> (proposal, prompt hidden [n, d], root)."""
    from confu_jax.decode.drafter import DraftInput, PrefillView
    from confu_jax.models.target import real_forward

    n = len(prompt)
    drafter = parse_drafter("mtp", plan)

    @jax.jit
    def first(target, dp, toks):
        out = real_forward(spec, tp, toks)
        root = jnp.argmax(out.logits_btv[:, -1], axis=-1).astype(jnp.int32)
        st = drafter.init(target, dp, PrefillView(toks, jnp.array([n]), root, out.taps_btc, None, 32,
                                                    out.hidden_btd[:, -1], out.hidden_btd))
        inp = DraftInput(root, jnp.array([n - 1]), jnp.zeros((1,), bool), jax.random.PRNGKey(0), jnp.float32(0.0),
                         jnp.float32(1.0))
        return drafter.propose(target, dp, st, inp), out.hidden_btd[0], root[0]

    prop, hidden, root = first(params.target, params.drafter_params, jnp.asarray([prompt], jnp.int32))
    return prop, np.asarray(hidden), int(root)


def _recursive_reference(spec, tp, m, prompt, hidden, path):
    """vLLM's / SGLang's recursion, written as one causal sequence: the depth-1 entries (x[j+1], h[j]) of
    the prompt and the root, then one entry per drafted token on ``path`` fed the previous entry's own
    output h' -> the last entry's logits (the next draft's distribution)."""
    cfg = spec.target
    tokens = list(prompt[1:]) + [path[0]]
    hid = [hidden[j] for j in range(len(prompt))]
    for tok in path[1:]:
        h = mtp_sequence(m, cfg, tp, jnp.asarray([tokens]), jnp.asarray(np.stack(hid))[None])
        hid.append(np.asarray(h[0, -1]))
        tokens.append(tok)
    h = mtp_sequence(m, cfg, tp, jnp.asarray([tokens]), jnp.asarray(np.stack(hid))[None])
    return np.asarray(mtp_logits(m, cfg, tp, h[:, -1:]))[0, 0]


@pytest.mark.slow
def test_drafts_are_the_recursive_module():
    """chain:3 is depth after depth the argmax of the recursion on the module's own output; in tree:3,2 each
    depth-1 node's children are the top-2 of its own recursion (they differ per parent, unlike Medusa's)."""
    spec, tp, params = setup(24, seed=1)
    m = params.drafter_params.weights["mtp"]
    prompt = [3, 9, 4, 17, 3, 9]
    prop, hidden, root = _first_proposal(spec, tp, params, "chain:3", prompt)
    chain = np.asarray(prop.tree.tokens_bt)[0].tolist()
    assert chain[0] == root
    for k in range(1, 4):
        want = _recursive_reference(spec, tp, m, prompt, hidden, chain[:k])
        assert chain[k] == int(np.argmax(want)), (k, chain)
    prop, _, _ = _first_proposal(spec, tp, params, "tree:3,2", prompt)
    toks, par = np.asarray(prop.tree.tokens_bt)[0], np.asarray(prop.tree.parents_bt)[0]
    below = {}
    for i in range(1, 4):
        want = _recursive_reference(spec, tp, m, prompt, hidden, [root, int(toks[i])])
        kids = [int(toks[j]) for j in range(len(toks)) if par[j] == i]
        assert kids == np.argsort(-want, kind="stable")[:2].tolist()
        below[i] = tuple(kids)
    assert len(set(below.values())) > 1, below




@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2", "tree:2,2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    drafter = parse_drafter("mtp", plan)
    assert_sampling_is_lossless(spec, tp, params, drafter, reps=2)


# ----------------------------------------------------------------------------- import / export


@pytest.mark.slow
def test_deepseek_layout_round_trip(tmp_path):
    import ml_dtypes

    from confu_jax.decode.families import decode_head
    from confu_jax.weights.mtp_format import is_mtp_dir, load_mtp_dir, save_mtp_dir
    from confu_jax.weights.safetensors_io import SafetensorsFile, save_file

    spec, tp, params = setup(6)
    cfg, m = spec.target, params.drafter_params.weights["mtp"]
    n = cfg.n_layers
    d = str(tmp_path / "mtp")
    save_mtp_dir(d, m, cfg)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert (c["num_nextn_predict_layers"], c["num_hidden_layers"], c["model_type"], c["hidden_size"]) == (
        1, n, "llama", cfg.d_model)
    names = set(SafetensorsFile(os.path.join(d, "model.safetensors")).names())
    assert names == {f"model.layers.{n}.{k}" for k in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    eh = SafetensorsFile(os.path.join(d, "model.safetensors")).get(f"model.layers.{n}.eh_proj.weight")
    np.testing.assert_array_equal(eh, np.asarray(m["eh_proj"]["kernel"]).T)  # torch [out, in] = [d, 2d]
    assert is_mtp_dir(d) and not is_mtp_dir(str(tmp_path))
    imp = load_mtp_dir(d)
    assert imp.layer_index == n and imp.shared == {}
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, m)
    # bf16 with the shared embedding / LM head (DeepSeek's checkpoints carry them), beside the main model's layers
    db = str(tmp_path / "bf16")
    save_mtp_dir(db, m, cfg, target_params=tp, dtype=ml_dtypes.bfloat16)
    f = SafetensorsFile(os.path.join(db, "model.safetensors"))
    sd = {k: np.array(f.get(k)) for k in f.names()}  # copies: the file is rewritten below
    assert {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"} <= set(sd)
    sd["model.layers.0.self_attn.q_proj.weight"] = np.asarray(tp["layers"]["q_proj"]["kernel"][0]).T  # main model
    save_file(sd, os.path.join(db, "model.safetensors"))
    imp = load_mtp_dir(db)
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), m)
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, rounded)
    head = decode_head("mtp", cfg, tp, db)  # the shared copies are the target's: accepted
    assert head.trained and f"layer {n}" in head.source
    # a module exported for another target is refused
    spec2, tp2, _ = make("eagle3", 6, seed=5)
    do = str(tmp_path / "other")
    save_mtp_dir(do, m, cfg, target_params=tp2)
    with pytest.raises(ValueError, match="exported for another target"):
        decode_head("mtp", cfg, tp, do)
    with pytest.raises(ValueError, match="cannot run as a layer of the target"):
        decode_head("mtp", cfg.replace(ffn_dim=cfg.ffn_dim * 2), tp, d)
    with pytest.raises(ValueError, match="neither an MTP"):
        decode_head("mtp", cfg, tp, str(tmp_path))
    # and it decodes exactly as the in-memory module
    drafter = parse_drafter("mtp", "tree:2,2")
    loaded = decode_head("mtp", cfg, tp, d)
    a = loop.generate_speculative(loaded.target, drafter, loaded.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    assert not decode_head("mtp", cfg, tp, None).trained


# ----------------------------------------------------------------------------- training

def _config(**extra):
    from configs.tiny_mtp import get_config
    from tests.helpers.train_resume import short_run_config

    return short_run_config(get_config, **extra)


def test_loss_equals_hand_computation():
    """The report's objective, recomputed with the torch reference module: depth k at i reads the true
    x[i+k] and depth k-1's output at i (the target's hidden state at depth 1), predicts x[i+k+1]; CE over
    the answer positions, averaged over depths, times λ."""
    import torch

    from confu_jax.models.target import real_forward
    from confu_jax.train.mtp_task import mtp_loss

    spec, tp, _ = make("eagle3", 24, seed=2)
    cfg = spec.target
    m = module_for(cfg, tp, seed=2)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 24, (2, 20)).astype(np.int32)
    mask = np.zeros((2, 20), bool)
    mask[0, 6:20], mask[1, 4:20] = True, True
    attention = np.ones((2, 20), np.int32)
    attention[1, 15:] = 0  # row 1: right padding after 15 tokens (the loss mask is cut by it)
    batch = {"tokens": toks, "loss_mask": mask.astype(np.int32), "attention_mask": attention}
    mask &= attention.astype(bool)
    loss, metrics = jit_static(mtp_loss)(spec, m, tp, jax.tree_util.tree_map(jnp.asarray, batch), num_depths=3,
                                         loss_weight=0.3)
    assert float(metrics["count/head0"]) == mask[:, 2:].sum()
    n_layers = cfg.n_layers
    sd = {k[len(f"model.layers.{n_layers}."):]: v for k, v in mtp_lib.to_reference_state_dict(m, n_layers).items()}
    ref = _torch_reference(cfg, sd, tp["embed"]["embedding"])
    hidden = jit_static(real_forward)(spec, tp, jnp.asarray(toks), return_logits=False).hidden_btd
    h = torch.from_numpy(np.asarray(hidden, np.float64))
    bsz, n = toks.shape
    pos = torch.arange(n)[None].expand(bsz, n)
    total = 0.0
    for k in range(1, 4):
        inp = np.zeros_like(toks)
        inp[:, :n - k] = toks[:, k:]
        with torch.no_grad():
            h, logits = ref.mtp(torch.from_numpy(inp), h, pos)
        lp = torch.log_softmax(logits, -1).numpy()
        nll, cnt = 0.0, 0
        for b in range(bsz):
            for i in range(n - k - 1):
                if mask[b, i + k + 1]:
                    nll -= lp[b, i, toks[b, i + k + 1]]
                    cnt += 1
        assert cnt > 0
        np.testing.assert_allclose(float(metrics[f"ce/head{k - 1}"]), nll / cnt, rtol=2e-4)
        total += nll / cnt
    np.testing.assert_allclose(float(loss), 0.3 * total / 3, rtol=2e-4)
    assert 1.0 <= float(metrics["acceptance_length"]) <= 4.0


def test_packed_rows_equal_padded_rows():
    """Two conversations packed into one row (block-diagonal attention, positions restarting) give the
    per-depth loss sums of the same conversations in padded rows: nothing crosses the boundary."""
    from confu_jax.train.mtp_task import mtp_loss

    spec, tp, params = setup(24, seed=4)
    m = params.drafter_params.weights["mtp"]
    rng = np.random.default_rng(0)
    a, b, n = rng.integers(0, 24, 9), rng.integers(0, 24, 11), 24
    ma, mb = np.r_[np.zeros(3), np.ones(6)], np.r_[np.zeros(4), np.ones(7)]
    padded = {"tokens": np.zeros((2, n), np.int32), "loss_mask": np.zeros((2, n), np.int32),
              "attention_mask": np.zeros((2, n), np.int32)}
    for r, (t, mk) in enumerate(((a, ma), (b, mb))):
        padded["tokens"][r, :len(t)], padded["loss_mask"][r, :len(t)], padded["attention_mask"][r, :len(t)] = t, mk, 1
    packed = {"tokens": np.zeros((1, n), np.int32), "loss_mask": np.zeros((1, n), np.int32),
              "attention_mask": np.zeros((1, n), np.int32), "segment_ids": np.zeros((1, n), np.int32),
              "positions": np.zeros((1, n), np.int32)}
    packed["tokens"][0, :20] = np.r_[a, b]
    packed["loss_mask"][0, :20] = np.r_[ma, mb]
    packed["attention_mask"][0, :20] = 1
    packed["segment_ids"][0, :20] = np.r_[np.ones(9), 2 * np.ones(11)]
    packed["positions"][0, :20] = np.r_[np.arange(9), np.arange(11)]
    loss = jax.jit(lambda batch: mtp_loss(spec, m, tp, batch, num_depths=3, loss_weight=1.0)[1])
    mp, mq = loss(packed), loss(padded)
    for k in range(3):
        assert float(mp[f"count/head{k}"]) == float(mq[f"count/head{k}"]) > 0
        np.testing.assert_allclose(float(mp[f"ce/head{k}"]), float(mq[f"ce/head{k}"]), rtol=1e-5)
        np.testing.assert_allclose(float(mp[f"acc/head{k}"]), float(mq[f"acc/head{k}"]), rtol=1e-6)


@pytest.mark.slow
def test_training_lowers_the_loss_and_the_run_loads(tmp_path):
    from confu_jax.decode.families import decode_head
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.mtp import is_mtp_workdir
    from confu_jax.train.loop import train
    from confu_jax.train.metric_writers import read_csv
    from confu_jax.train.target_loading import load_target

    workdir = str(tmp_path / "mtp")
    config = _config(**{"train.steps": 20, "train.eval_every": 10, "train.checkpoint.every": 10})
    assert train(config, workdir).step == 20
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.85 * first, (first, last)
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"]
    assert {"acc/head0", "acc/head2", "acceptance_length"} <= set(ev[-1])
    assert is_mtp_workdir(workdir)
    spec, tp = load_target(config, model_spec_from_config(config))
    head = decode_head("mtp", spec.target, tp, workdir)
    assert head.trained and "step 20" in head.source
    trained = head.drafter_params.weights["mtp"]
    assert np.abs(np.asarray(trained["eh_proj"]["kernel"]) - np.asarray(
        init_mtp(jax.random.PRNGKey(0), spec.target, tp)["eh_proj"]["kernel"])).max() > 0
    mtp_lib.check_mtp_params(trained, spec.target)  # decodes as any module does (tests/contract/test_family_contract.py)
    # the CLI's --mtp_shared export (subprocess: no launch module in-process) also stores the target's
    # embedding and LM head, as DeepSeek's checkpoints do, and loads back to the run's weights
    from tests.helpers.train_resume import resume_env

    from confu_jax.weights.mtp_format import load_mtp_dir

    out = str(tmp_path / "export")
    p = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", workdir, "--format", "mtp",
                        "--out", out, "--mtp_shared"], cwd=REPO, env=resume_env(tmp_path), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 20" in p.stdout and "with the shared embedding / LM head" in p.stdout, p.stdout
    imp = load_mtp_dir(out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, trained)
    assert set(imp.shared) == {"embed_tokens.weight", "shared_head.head.weight"}
