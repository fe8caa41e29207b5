"""DFlash (``models.dflash``, ``decode.dflash``, ``train.dflash_task``, ``weights.dflash_format``,
``runs.dflash``).

Forward parity is checked against torch: a transcription of the reference's ``DFlashDraftModel``
(z-lab/dflash ``dflash/model.py`` at 44947fbf71114e241c96de194f4b382b5dd330d0: ``Qwen3DFlashAttention``
with the context K/V concatenated before the block's, ``Qwen3DFlashDecoderLayer``, ``fc`` ->
``hidden_norm``, final ``norm``) built from transformers' Qwen3 modules and loaded from our export with
strict=True (the reference package itself pins transformers 4.57 and pulls datasets / sglang extras;
its module was checked against this transcription by hand once, 2e-6 apart in float64).

(1) forward (decode form, training blocks) against the transcription; (2) in the loop: greedy output
equals AR (chain, tree, sampled chain at T=0; two prompts of different lengths, EOS inside a draft), the
drafted block is the reference loop's, chi-square at T=1 against the exact joint, sharded equals
single-device; (3) the published layout round trip; (4) the loss equals a hand computation, a short run
lowers it and decodes losslessly, and a killed run resumes with identical losses.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop, sharded
from confu_jax.decode.dflash import DFlashDrafter, parse_dflash_plan
from confu_jax.decode.drafters import parse_drafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.spec_params import SpecParams
from confu_jax.decode.stopping import StopReason
from confu_jax.models import dflash as D
from confu_jax.models.registry import get_method
from test_spec_loop import _chi_square, _exact_joint, _rows, make

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]
MASK = 3  # the mask token of the tests' drafts


def draft_for(dcfg, n_taps, seed=0, std=0.3):
    """A DFlash draft with every term acting: kernels large, norm scales perturbed."""
    p = jax.tree_util.tree_map(np.array, D.init_dflash(jax.random.PRNGKey(seed), dcfg, n_taps, init_std=std))
    rng = np.random.default_rng(seed + 1)
    for path, x in list(D._leaves(p).items()):
        if path.endswith("scale"):
            node = p
            *parents, leaf = path.split("/")
            for q in parents:
                node = node[q]
            node[leaf] = (1 + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
    return p


def setup(vocab, seed=0, n_layers=2, **kw):
    spec, tp, _ = make("eagle3", vocab, seed=seed, **kw)
    dcfg = D.draft_config(spec.target, n_layers, rope_theta=50000.0, rms_eps=1e-6)
    spec = dataclasses.replace(spec, draft_model=dcfg)
    p = draft_for(dcfg, len(spec.taps), seed=seed)
    return spec, tp, SpecParams(target=tp, draft={"dflash": {**p, "mask_token_id": np.int32(MASK % vocab)}},
                                confu={}, draft_vocab={})


# ----------------------------------------------------------------------------- the reference


def _torch_reference(dcfg, n_taps, sd):
    """The reference's DFlashDraftModel.forward, transcribed on transformers' Qwen3 modules (float64, eager
    attention over [context ; block] with an explicit additive mask), loaded with strict=True."""
    import torch
    import torch.nn as nn
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    hf = Qwen3Config(vocab_size=dcfg.vocab_size, hidden_size=dcfg.d_model, intermediate_size=dcfg.ffn_dim,
                     num_attention_heads=dcfg.n_heads, num_key_value_heads=dcfg.n_kv_heads, head_dim=dcfg.head_dim,
                     num_hidden_layers=dcfg.n_layers, rms_norm_eps=dcfg.rms_eps, rope_theta=dcfg.rope_theta,
                     max_position_embeddings=dcfg.max_position_embeddings, attention_bias=False)
    hd, hq, hkv = dcfg.head_dim, dcfg.n_heads, dcfg.n_kv_heads

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(dcfg.d_model, hq * hd, bias=False)
            self.k_proj = nn.Linear(dcfg.d_model, hkv * hd, bias=False)
            self.v_proj = nn.Linear(dcfg.d_model, hkv * hd, bias=False)
            self.o_proj = nn.Linear(hq * hd, dcfg.d_model, bias=False)
            self.q_norm = Qwen3RMSNorm(hd, eps=hf.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(hd, eps=hf.rms_norm_eps)

        def forward(self, x, ctx, cos, sin, mask):
            b, q_len = x.shape[:2]
            c_len = ctx.shape[1]
            q = self.q_norm(self.q_proj(x).view(b, q_len, -1, hd)).transpose(1, 2)
            k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, c_len + q_len, -1, hd)
            v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, c_len + q_len, -1, hd).transpose(1, 2)
            k = self.k_norm(k).transpose(1, 2)
            cq, sq = cos[:, None, -q_len:], sin[:, None, -q_len:]  # the reference's apply_rotary_pos_emb
            q = q * cq + rotate_half(q) * sq
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            k = k.repeat_interleave(hq // hkv, 1)
            v = v.repeat_interleave(hq // hkv, 1)
            s = q @ k.transpose(-1, -2) * hd ** -0.5 + mask[:, None]
            o = torch.softmax(s, -1) @ v
            return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()
            self.mlp = Qwen3MLP(hf)
            self.input_layernorm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.post_attention_layernorm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)

        def forward(self, x, ctx, cos, sin, mask):
            x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(dcfg.n_layers)])
            self.fc = nn.Linear(n_taps * dcfg.d_model, dcfg.d_model, bias=False)
            self.hidden_norm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.norm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.rotary_emb = Qwen3RotaryEmbedding(hf)

        def forward(self, position_ids, noise_embedding, target_hidden, mask):
            """mask [B, Q, C+Q] bool (True = visible)."""
            x = noise_embedding
            ctx = self.hidden_norm(self.fc(target_hidden))
            cos, sin = self.rotary_emb(x, position_ids)
            add = torch.where(mask, 0.0, float("-inf")).to(x.dtype)
            for layer in self.layers:
                x = layer(x, ctx, cos, sin, add)
            return self.norm(x)

    ref = Model().double()
    ref.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in sd.items()}, strict=True)
    return ref


def test_forward_equals_reference():
    import torch

    spec, tp, params = setup(24)
    dcfg, p = spec.draft_model, D.model_params(params.draft["dflash"])
    n_taps = len(spec.taps)
    ref = _torch_reference(dcfg, n_taps, D.to_reference_state_dict(p))
    rng = np.random.default_rng(3)
    b, s, bs = 2, 7, 4
    taps = (2 * rng.standard_normal((b, s, n_taps * dcfg.d_model))).astype(np.float32)
    noise = rng.standard_normal((b, bs, dcfg.d_model)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s + bs) + 3, (b, s + bs)).copy()  # RoPE offset: positions matter
    # the decode form: every context slot and the whole block visible (the reference's is_causal=False)
    with torch.no_grad():
        want = ref(torch.from_numpy(pos), torch.from_numpy(noise).double(), torch.from_numpy(taps).double(),
                   torch.ones(b, bs, s + bs, dtype=torch.bool)).numpy()
    assert np.abs(want).std() > 0.1
    k, v = D.sequence_context(p, dcfg, jnp.asarray(taps), jnp.asarray(pos[:, :s]))
    got = D.block_hidden(p, dcfg, jnp.asarray(noise), jnp.asarray(pos[:, s:]), jnp.ones((b, bs, bs), bool), k, v,
                         jnp.full((b,), s))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    # the context committed through the cache helpers in two pieces gives the same block
    from confu_jax.models.kv_cache import commit, init_cache

    cache = init_cache(dcfg.n_layers, b, 16, dcfg.n_kv_heads, dcfg.head_dim)
    for lo, hi in ((0, 4), (4, s)):
        kk, vv = D.context_kv(p, dcfg, D.context_features(p, dcfg, jnp.asarray(taps[:, lo:hi])),
                              jnp.asarray(pos[:, lo:hi]))
        cache = commit(cache, kk, vv, jnp.full((b,), hi - lo))
    got2 = D.block_hidden(p, dcfg, jnp.asarray(noise), jnp.asarray(pos[:, s:]), jnp.ones((b, bs, bs), bool),
                          cache.k_lbhsd, cache.v_lbhsd, cache.length_b)
    np.testing.assert_allclose(np.asarray(got2), want, rtol=2e-4, atol=2e-4)
    # training blocks: anchors 2 and 5 of a row, each block sees the context before its anchor and itself
    tokens = rng.integers(0, 24, (b, s))
    anchors = np.array([[2, 5], [1, 4]])
    h = D.draft_blocks(p, dcfg, spec.target, tp, jnp.asarray(taps), jnp.asarray(tokens), jnp.asarray(anchors), MASK,
                       bs)
    emb = np.asarray(tp["embed"]["embedding"])
    for r in range(b):
        for i, a in enumerate(anchors[r]):
            blk = np.r_[tokens[r, a], np.full(bs - 1, MASK)]
            mask = np.zeros((1, bs, s + bs), bool)
            mask[:, :, :a] = True
            mask[:, :, s:] = True
            with torch.no_grad():
                w = ref(torch.from_numpy(np.r_[np.arange(s), a + np.arange(bs)][None]),
                        torch.from_numpy(emb[blk][None]).double(), torch.from_numpy(taps[r:r + 1]).double(),
                        torch.from_numpy(mask)).numpy()
            np.testing.assert_allclose(np.asarray(h[r, i]), w[0], rtol=2e-4, atol=2e-4)
    # names round trip
    back = D.from_reference_state_dict(D.to_reference_state_dict(p), dcfg, n_taps)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, p)
    D.check_dflash_params(p, dcfg, n_taps)
    sd = D.to_reference_state_dict(p)
    with pytest.raises(ValueError, match="missing keys"):
        D.from_reference_state_dict({k: x for k, x in sd.items() if "q_norm" not in k}, dcfg, n_taps)
    with pytest.raises(ValueError, match="expected shape"):
        D.from_reference_state_dict(sd, dcfg.replace(ffn_dim=dcfg.ffn_dim * 2), n_taps)


def test_target_layer_ids():
    """The reference's default layers, and our taps (states entering layer l+1)."""
    assert D.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # configs/qwen3-8b-dflash.json in SpecForge
    assert D.build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]  # qwen2.5-0.5b
    assert D.build_target_layer_ids(8, 1) == [4]
    assert D.taps_for_layer_ids([1, 3, 5]) == (2, 4, 6)
    assert D.layer_ids_for_taps((2, 4, 6)) == [1, 3, 5]


def test_plan_parsing():
    d = parse_drafter("dflash", "tree:2,2,1")
    assert isinstance(d, DFlashDrafter) and d.n_nodes == 1 + 2 + 4 + 4 and d.max_depth == 3
    assert d.describe() == "tree:2,2,1" and d.rule(True) == "greedy"
    assert parse_drafter("dflash", "chain:15").plan.k == 15
    assert parse_drafter("dflash", "sampled_chain:2").rule(False) == "sampled_chain"
    with pytest.raises(ValueError, match="contemplates"):
        parse_dflash_plan("chain:3+c2")
    assert get_method("dflash").needs_head and get_method("dflash").speculative
    spec, tp, _ = setup(6)
    with pytest.raises(ValueError, match="needs params.draft\\['dflash'\\]"):
        loop.generate_speculative(spec, SpecParams(target=tp, draft={}, confu={}, draft_vocab={}),
                                  parse_drafter("dflash", "chain:2"), PROMPTS, max_new_tokens=4, eos_ids=())


# ----------------------------------------------------------------------------- in the loop


def test_block_is_the_reference_loop():
    """The first proposal is the reference's first block: [root, M, M, M] at positions n..n+3 over the
    prompt's taps (every context slot visible), each drafted token the argmax of its own position."""
    from confu_jax.decode.drafter import DraftInput, PrefillView
    from confu_jax.models.target import real_forward

    spec, tp, params = setup(24, seed=1)
    p = D.model_params(params.draft["dflash"])
    prompt = [3, 9, 4, 17, 3, 9]
    n = len(prompt)
    toks = jnp.asarray([prompt], jnp.int32)
    out = real_forward(spec, tp, toks)
    root = jnp.argmax(out.logits_btv[:, -1], axis=-1).astype(jnp.int32)
    drafter = parse_drafter("dflash", "chain:3")
    st = drafter.init(spec, params, PrefillView(toks, jnp.array([n]), root, out.taps_btc, None, 32))
    inp = DraftInput(root, jnp.array([n - 1]), jnp.zeros((1,), bool), jax.random.PRNGKey(0), jnp.float32(0.0),
                     jnp.float32(1.0))
    prop = drafter.propose(spec, params, st, inp)
    chain = np.asarray(prop.tree.tokens_bt)[0].tolist()
    k, v = D.sequence_context(p, spec.draft_model, out.taps_btc)
    blk = jnp.asarray([[int(root[0]), MASK, MASK, MASK]])
    h = D.block_hidden(p, spec.draft_model, D.embed_block(tp, blk), jnp.arange(n, n + 4)[None],
                       jnp.ones((1, 4, 4), bool), k, v, jnp.array([n]))
    want = np.argmax(np.asarray(D.block_logits(spec.target, tp, h))[0, 1:], -1)
    assert chain == [int(root[0])] + want.tolist()
    # a tree's depth-d nodes are position d's top-k, the same under every parent
    prop = drafter.__class__(parse_dflash_plan("tree:2,2")).propose(spec, params, st, inp)
    toks, par = np.asarray(prop.tree.tokens_bt)[0], np.asarray(prop.tree.parents_bt)[0]
    kids = [sorted(int(toks[j]) for j in range(len(toks)) if par[j] == i) for i in (1, 2)]
    assert kids[0] == kids[1] and len(kids[0]) == 2


PLANS = ["chain:3", "tree:2,2,1", "sampled_chain:2"]


@pytest.mark.parametrize("plan", PLANS)
def test_greedy_equals_ar(plan):
    spec, tp, params = setup(6)
    drafter = parse_drafter("dflash", plan)
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=())
    sp = loop.generate_speculative(spec, params, drafter, PROMPTS, max_new_tokens=30, eos_ids=())
    assert _rows(sp, 2) == _rows(ar, 2)
    log = np.asarray(sp.accept_log_bi)
    assert np.array_equal(log.sum(1) + 1, np.asarray(sp.n_generated_b))
    assert np.max(log) > 1  # drafts were accepted, not just lossless
    eos = _rows(ar, 2)[0][11]  # EOS inside a draft: rows stop at different times
    ar_e = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=(eos,))
    sp_e = loop.generate_speculative(spec, params, drafter, PROMPTS, max_new_tokens=30, eos_ids=(eos,))
    assert _rows(sp_e, 2) == _rows(ar_e, 2)
    assert np.array_equal(np.asarray(sp_e.stop_reason_b), np.asarray(ar_e.stop_reason_b))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2", "chain:2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=3, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    drafter = parse_drafter("dflash", plan)
    prompt = [1, 3, 1, 3, 2, 1]
    joint = _exact_joint(spec, tp, prompt, 1.0, 1.0)
    n_per, reps = 25_000, 4
    samples = []
    for r in range(reps):
        res = loop.generate_speculative(spec, params, drafter, [prompt] * n_per, max_new_tokens=3, eos_ids=(),
                                        temperature=1.0, top_p=1.0, seed=300 + r, min_bucket=8)
        assert np.all(np.asarray(res.n_generated_b) == 3)
        samples.append(np.asarray(res.tokens_bn)[:, :3])
        assert np.asarray(res.accept_log_bi).max() > 1
    p = _chi_square(np.concatenate(samples), joint, n_per * reps)
    assert p > 1e-3, p


def test_sharded_equals_single_device():
    prompts = PROMPTS * 2
    spec, tp, params = setup(6)
    for plan in ("chain:3", "tree:2,2"):
        drafter = parse_drafter("dflash", plan)
        single = loop.generate_speculative(spec, params, drafter, prompts, max_new_tokens=16, eos_ids=())
        out = loop.generate_speculative(spec, params, drafter, prompts, max_new_tokens=16, eos_ids=(),
                                        mesh=sharded.parse_mesh("data=2,tensor=2"))
        assert _rows(out, 4) == _rows(single, 4)
        np.testing.assert_array_equal(np.asarray(out.accept_log_bi), np.asarray(single.accept_log_bi))
        assert np.all(np.asarray(out.stop_reason_b) == StopReason.MAX_NEW_TOKENS)
