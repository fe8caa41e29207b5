"""IBM's MLP speculator (``models.mlp_speculator``, ``decode.mlp_speculator``, ``train.mlp_speculator_task``,
``weights.mlp_speculator_format``, ``runs.mlp_speculator``).

Forward parity is a **transcription** test: fms-extras (the reference, ``fms_extras/models/speculator.py``)
is not on PyPI, and the ``ibm-fms`` package there ships only its ``LayerNormParameterized``, not the
speculator. So ``_NumpyReference`` re-implements the reference's ``MLPSpeculator.forward`` and
``generate_suffixes`` (and fms's ``LayerNormParameterized``, use_mean=False, eps 1e-6; torch's exact
GELU) in float64 numpy, line by line from the reference code, reading the reference's state dict keys;
a torch module with the reference's structure loads our export with ``strict=True`` (the key names are
the reference's, tied or not).

(1) forward and reference initialisation; the tree drafted for ``tree:k1,..,kD`` holds exactly the
reference's ``generate_suffixes`` candidates (per-node state along each path); (2) in the loop, greedy
output equals AR (chain, static tree, dynamic tree, sampled chain at T=0; 2 prompts of different
lengths, EOS inside a draft), a tree holding every token accepts its full depth, the state is the
target's hidden state at the last accepted node; sampled output passes the chi-square test against the
exact joint (greedy = AR for every plan shape and sharded = single device: tests/contract/test_family_contract.py); (3) the published format round trip (untied, tied with every
key or only the shared ones, bf16, pytorch_model.bin) and decoding from it; (4) the loss equals a hand
computation with the transcription, a tied run lowers it and decodes losslessly; a killed run resumes
with identical losses and exports through ``launch.export_head --format mlp_speculator`` (subprocess).
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.drafter import DraftInput
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.hidden_state import LastHiddenState
from confu_jax.decode.mlp_speculator import MLPSpeculatorDrafter, parse_mlp_speculator_plan
from confu_jax.models import mlp_speculator as ms
from confu_jax.decode.families import get_method
from confu_jax.train.metric_writers import read_csv
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import generated_rows, jit_propose, make, own

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]
# the speculator's pieces under jit (tests/helpers/jitting.py: called eagerly, every primitive compiles on its own)
init_mlp_speculator, mlp_speculator_logits, input_state, stage_state, stage_logits = (
    jit_static(f) for f in (ms.init_mlp_speculator, ms.mlp_speculator_logits, ms.input_state, ms.stage_state,
                            ms.stage_logits))


def speculator_for(d, vocab, n_predict=3, inner_dim=32, tie_weights=False, scale_input=False, std=0.4, seed=0):
    """Reference-initialised stages with LN scale / shift and weights perturbed, so every term acts."""
    c = ms.make_config(n_predict, d, vocab, inner_dim, tie_weights, scale_input)
    p = jax.tree_util.tree_map(np.array, init_mlp_speculator(jax.random.PRNGKey(seed), c))
    rng = np.random.default_rng(seed + 1)
    t = jax.tree_util.tree_map(np.array, ms.to_trainable(p, c))
    t["ln"]["scale"] = (1 + 0.3 * rng.standard_normal(t["ln"]["scale"].shape)).astype(np.float32)
    t["ln"]["bias"] = (0.3 * rng.standard_normal(t["ln"]["bias"].shape)).astype(np.float32)
    t["lm_head"]["kernel"] = (std * rng.standard_normal(t["lm_head"]["kernel"].shape)).astype(np.float32)
    return jax.tree_util.tree_map(np.asarray, ms.from_trainable(t, c)), c


def setup(vocab, n_predict=3, seed=0, **kw):
    spec, tp, _ = make("eagle3", vocab, seed=seed, **kw)
    p, _ = speculator_for(spec.target.d_model, vocab, n_predict, seed=seed)
    return spec, tp, own(spec, tp, {"mlp_speculator": p})


# ----------------------------------------------------------------------------- the reference, transcribed


class _NumpyReference:
    """fms-extras ``MLPSpeculator`` in float64 numpy, from ``fms_extras/models/speculator.py`` (commit
    16339f7): ``__init__`` (weights, tying, state_weight / emb_weight), ``forward`` and
    ``generate_suffixes``; ``_ln`` is fms ``LayerNormParameterized.forward`` (use_mean=False,
    eps=1e-6), ``_gelu`` torch's ``nn.GELU()`` (approximate='none'). Reads the reference's keys."""

    def __init__(self, sd, emb_dim, inner_dim, vocab_size, n_predict, tie_weights=False, scale_input=False):
        self.n_predict = n_predict
        inner_dim = inner_dim if inner_dim != 0 else emb_dim
        self.inner_dim = inner_dim
        self.scale_input = scale_input
        w = {k.replace("speculator.", ""): np.asarray(v, np.float64) for k, v in sd.items()}
        self.emb = [w[f"emb.{i}.weight"] for i in range(n_predict)]
        self.proj = [w[f"proj.{i}.weight"] for i in range(n_predict)]
        self.head = [w[f"head.{i}.weight"] for i in range(n_predict)]
        self.ln = [(w[f"ln.{i}.weight"], w[f"ln.{i}.bias"]) for i in range(n_predict)]
        if tie_weights:  # emb / head / ln = stage 0's; proj[2:] = proj[1]
            self.emb = [self.emb[0]] * n_predict
            self.head = [self.head[0]] * n_predict
            self.ln = [self.ln[0]] * n_predict
            self.proj = self.proj[:2] + [self.proj[1]] * (n_predict - 2)
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (self.inner_dim / 2))

    @staticmethod
    def _ln(x, weight=None, bias=None, eps=1e-06):
        xf = x * (1.0 / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps))
        if weight is not None:
            xf = weight * xf
        if bias is not None:
            xf = xf + bias
        return xf

    @staticmethod
    def _gelu(x):
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))

    def _stage(self, i, state, z):
        state = state @ self.proj[i].T
        state = state + z * (self.emb_weight / self.state_weight)  # torch.add(state, z, alpha=...)
        return self._gelu(self._ln(state, *self.ln[i]))

    def forward(self, state, inds):
        out = []
        state = np.asarray(state, np.float64)
        if self.scale_input:
            state = self._ln(state) / (2 ** 0.5)
        for i in range(self.n_predict):
            z = self.emb[i][inds[:, i: i + state.shape[1]]]  # b n d
            state = self._stage(i, state, z)
            out.append(state @ self.head[i].T)  # b n v
        return np.stack(out, axis=0)  # h b n v

    def generate_suffixes(self, state, ind, topk, n):
        b = state.shape[0]
        k = math.prod(topk)
        out = np.zeros((b, 1, k, self.n_predict), np.int64)
        log_probs = np.zeros((b, 1, k))
        assert len(topk) == self.n_predict
        state = np.asarray(state, np.float64)
        if self.scale_input:
            state = self._ln(state) / (2 ** 0.5)
        for i in range(self.n_predict):
            z = self.emb[i][ind]  # b k d
            state = self._stage(i, state, z)
            logits = state @ self.head[i].T
            probs = logits - logits.max(2, keepdims=True)
            probs = probs - np.log(np.exp(probs).sum(2, keepdims=True))  # log_softmax, dim=2
            preds = np.argsort(-probs, axis=2, kind="stable")[:, :, : topk[i]]  # probs.topk(topk[i], dim=2)
            probs = np.take_along_axis(probs, preds, axis=2)
            out = out.reshape(b, preds.shape[1] * preds.shape[2], -1, self.n_predict)
            out[:, :, :, i] = preds.reshape(b, -1, 1)
            state = np.repeat(state[:, :, None, :], topk[i], axis=2)  # unsqueeze(2).expand(-1, -1, topk[i], -1)
            state = state.reshape(b, -1, state.shape[3])
            ind = preds.reshape(b, -1)
            log_probs = log_probs.reshape(b, probs.shape[1] * probs.shape[2], -1)
            log_probs = log_probs + probs.reshape(b, -1, 1)
        out = out.reshape(b, k, self.n_predict)
        log_probs = log_probs.reshape(b, k)
        best_guesses = np.argsort(-log_probs, axis=1, kind="stable")[:, :n]
        return np.take_along_axis(out, best_guesses[:, :, None], axis=1)


def _reference(p, c):
    return _NumpyReference(ms.to_reference_state_dict(p), c.emb_dim, c.inner_dim, c.vocab_size, c.n_predict,
                           c.tie_weights, c.scale_input)


def _torch_reference_module(c):
    """The reference's module structure (names, shapes, tying), transcribed: our export must load
    into it with strict=True."""
    import torch
    import torch.nn as nn

    class LayerNormParameterized(nn.Module):
        def __init__(self, dim, elementwise_shift, elementwise_scale):
            super().__init__()
            if elementwise_scale:
                self.weight = nn.Parameter(torch.ones(dim))
            if elementwise_shift:
                self.bias = nn.Parameter(torch.zeros(dim))

    class MLPSpeculator(nn.Module):
        def __init__(self):
            super().__init__()
            k, dd = c.n_predict, c.inner_dim
            self.emb = nn.ModuleList([nn.Embedding(c.vocab_size, dd) for _ in range(k)])
            self.proj = nn.ModuleList([nn.Linear(c.emb_dim if i == 0 else dd, dd, bias=False) for i in range(k)])
            self.head = nn.ModuleList([nn.Linear(dd, c.vocab_size, bias=False) for _ in range(k)])
            self.ln = nn.ModuleList([LayerNormParameterized(dd, True, True) for _ in range(k)])
            if c.scale_input:
                self.ln0 = LayerNormParameterized(c.emb_dim, False, False)
            if c.tie_weights:
                for emb in self.emb:
                    emb.weight = self.emb[0].weight
                for head in self.head:
                    head.weight = self.head[0].weight
                for ln in self.ln:
                    ln.weight, ln.bias = self.ln[0].weight, self.ln[0].bias
                for i in range(2, k):
                    self.proj[i].weight = self.proj[1].weight

    return MLPSpeculator()


@pytest.mark.parametrize("tie_weights,scale_input", [(False, False), (True, True)])
def test_forward_equals_reference_transcription(tie_weights, scale_input):
    import torch

    p, c = speculator_for(24, 20, n_predict=4, inner_dim=16, tie_weights=tie_weights, scale_input=scale_input)
    rng = np.random.default_rng(3)
    h = (3 * rng.standard_normal((2, 5, 24))).astype(np.float32)
    inds = rng.integers(0, 20, (2, 5 + 4))
    ours = np.asarray(mlp_speculator_logits(p, jnp.asarray(h), jnp.asarray(inds)))  # [K,2,5,V]
    want = _reference(p, c).forward(h, inds)
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=2e-4)
    assert np.abs(want).max() > 1  # not a vanishing comparison
    # the stage functions the drafter uses give the same logits
    s = input_state(p, jnp.asarray(h))
    for i in range(4):
        s = stage_state(p, i, s, jnp.asarray(inds[:, i:i + 5]))
        np.testing.assert_allclose(np.asarray(stage_logits(p, i, s)), want[i], rtol=2e-4, atol=2e-4)
    # the key names and tying are the reference module's: strict load of our export
    sd = {k: torch.from_numpy(np.array(v)) for k, v in ms.to_reference_state_dict(p).items()}
    _torch_reference_module(c).load_state_dict(sd, strict=True)
    # round trip through the reference state dict
    back = ms.from_reference_state_dict(ms.to_reference_state_dict(p), c)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, p)
    assert ms.is_tied(p) == tie_weights
    with pytest.raises(ValueError, match="N \\+ n_predict"):
        ms.mlp_speculator_logits(p, jnp.asarray(h), jnp.asarray(inds[:, :6]))


def test_reference_initialisation():
    c = ms.make_config(3, 64, 500, inner_dim=48)
    assert c.state_weight == pytest.approx(0.5 ** (0.5 / 3))
    assert c.emb_weight == pytest.approx(math.sqrt((1 - 0.5 ** (1 / 3)) * 24))
    p = jax.tree_util.tree_map(np.asarray, init_mlp_speculator(jax.random.PRNGKey(0), c))
    assert ms.config_of(p) == c and "ln0" not in p
    for a, b in (("emb", "embedding"), ("proj_in", "kernel"), ("proj", "kernel"), ("lm_head", "kernel")):
        # reset_parameters: N(0, 1/sqrt(inner_dim)) for every embedding and linear (proj.0 included)
        assert np.std(p[a][b]) == pytest.approx(1 / math.sqrt(48), rel=0.05), (a, np.std(p[a][b]))
        assert abs(np.mean(p[a][b])) < 0.01
    assert not np.array_equal(p["emb"]["embedding"][0], p["emb"]["embedding"][1])  # untied: own draws
    np.testing.assert_array_equal(p["ln"]["scale"], 1)
    np.testing.assert_array_equal(p["ln"]["bias"], 0)
    assert ms.make_config(2, 64, 10).inner_dim == 64  # inner_dim 0 = emb_dim
    with pytest.raises(ValueError, match="tie_weights needs n_predict >= 2"):
        ms.make_config(1, 64, 10, tie_weights=True)
    # tied: one draw repeated; scale_input: ln0 = the constant 1/sqrt(2); trainable layout holds it once
    ct = ms.make_config(3, 64, 500, inner_dim=48, tie_weights=True, scale_input=True)
    pt = jax.tree_util.tree_map(np.asarray, init_mlp_speculator(jax.random.PRNGKey(1), ct))
    assert ms.is_tied(pt) and ms.config_of(pt).scale_input
    np.testing.assert_allclose(pt["ln0"]["scale"], 1 / math.sqrt(2))
    assert not np.array_equal(pt["proj_in"]["kernel"][:48], pt["proj"]["kernel"][0])  # proj.0 stays its own
    shapes = jax.tree_util.tree_map(lambda x: x.shape, ms.to_trainable(pt, ct))
    assert shapes == jax.tree_util.tree_map(lambda x: x.shape, ms.trainable_shapes(ct))
    assert shapes["emb"]["embedding"] == (1, 500, 48) and shapes["proj"]["kernel"] == (1, 48, 48)


def test_tied_gradient_is_the_sum_over_stages():
    """Training the trainable layout of a tied model = the reference's shared parameters: the
    gradient of a shared weight is the sum of the per-stage gradients of the broadcast layout."""
    p, c = speculator_for(16, 12, n_predict=3, inner_dim=8, tie_weights=True, scale_input=True)
    t = ms.to_trainable(p, c)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    inds = jnp.asarray(rng.integers(0, 12, (2, 7)))

    def loss_stage(sp):
        return jnp.sum(jax.nn.log_softmax(ms.mlp_speculator_logits(sp, h, inds))[..., 0])

    g_shared = jax.jit(jax.grad(lambda t: loss_stage(ms.from_trainable(t, c))))(t)
    g_stage = jax.jit(jax.grad(loss_stage))(jax.tree_util.tree_map(jnp.asarray, p))
    np.testing.assert_allclose(g_shared["emb"]["embedding"][0], g_stage["emb"]["embedding"].sum(0), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(g_shared["proj"]["kernel"][0], g_stage["proj"]["kernel"].sum(0), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(g_stage["emb"]["embedding"][2])).max() > 0  # every stage contributes


def _propose(spec, tp, p, plan, h_bd, root_b):
    params = own(spec, tp, {"mlp_speculator": p})
    b = root_b.shape[0]
    inp = DraftInput(jnp.asarray(root_b, jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
                     jax.random.PRNGKey(0), jnp.float32(0.0), jnp.float32(1.0))
    return jit_propose(parse_drafter("mlp_speculator", plan), params.target, params.drafter_params,
                       LastHiddenState(jnp.asarray(h_bd)), inp)


@pytest.mark.parametrize("scale_input", [False, True])
def test_tree_holds_the_reference_candidates(scale_input):
    """tree:3,2,2 = the reference's top_k_tokens_per_head [3, 2, 2]: the tree's full-depth paths are
    exactly ``generate_suffixes``' 12 candidates (each node's children come from its own state), and
    chain:3 is its single best candidate of topk [1, 1, 1]."""
    spec, tp, _ = make("eagle3", 24)
    p, c = speculator_for(spec.target.d_model, 24, n_predict=3, inner_dim=32, scale_input=scale_input, std=1.0)
    ref = _reference(p, c)
    rng = np.random.default_rng(7)
    h = rng.standard_normal((2, spec.target.d_model)).astype(np.float32)
    root = np.array([5, 17])
    prop = _propose(spec, tp, p, "tree:3,2,2", h, root)
    tree = prop.tree
    assert prop.q_btv is None and np.all(np.asarray(prop.n_nodes_b) == 1 + 3 + 6 + 12)
    toks, depth, path = (np.asarray(x) for x in (tree.tokens_bt, tree.depth_bt, tree.path_btd))
    want = ref.generate_suffixes(h[:, None], root[:, None], [3, 2, 2], 12)
    for b in range(2):
        assert toks[b, 0] == root[b]
        ours = {tuple(toks[b, path[b, i, 1:]]) for i in range(toks.shape[1]) if depth[b, i] == 3}
        assert ours == {tuple(x) for x in want[b].tolist()}
        # unlike Medusa's, a node's children depend on its path: different depth-1 parents, different children
        below = {a: frozenset(x[1:] for x in ours if x[0] == a) for a in {x[0] for x in ours}}
        assert len(set(below.values())) > 1, below
    chain = np.asarray(_propose(spec, tp, p, "chain:3", h, root).tree.tokens_bt)
    np.testing.assert_array_equal(chain[:, 1:], ref.generate_suffixes(h[:, None], root[:, None], [1, 1, 1], 1)[:, 0])


def test_plan_parsing():
    d = parse_drafter("mlp_speculator", "tree:2,2,1")
    assert isinstance(d, MLPSpeculatorDrafter) and d.n_nodes == 1 + 2 + 4 + 4 and d.max_depth == 3
    assert d.describe() == "tree:2,2,1" and d.rule(True).name == "greedy"
    assert parse_drafter("mlp_speculator", "chain:3").plan.k == 3
    assert parse_drafter("mlp_speculator", "sampled_chain:2").rule(False).name == "sampled_chain"
    assert parse_drafter("mlp_speculator", "dynamic:3,2,5").n_nodes == 1 + 5  # N drafted nodes + the root
    with pytest.raises(ValueError, match="contemplates"):
        parse_mlp_speculator_plan("chain:3+c2")
    with pytest.raises(ValueError, match="k_i >= 1"):
        parse_mlp_speculator_plan("tree:2,0")
    with pytest.raises(ValueError, match="expected chain:K"):
        parse_mlp_speculator_plan("tree:2,x")
    from confu_jax.bench import budget, cli_args

    assert "mlp_speculator" in cli_args.plan_families("tree:2,2")
    assert "mlp_speculator" in cli_args.plan_families("chain:2")
    chains, trees = budget.default_candidates("mlp_speculator")
    assert all(parse_drafter("mlp_speculator", p).max_depth <= 3 for p in chains + trees)
    assert get_method("mlp_speculator").needs_head and get_method("mlp_speculator").speculative
    spec, tp, params = setup(6, n_predict=2)
    with pytest.raises(ValueError, match="depth <= n_predict"):
        loop.generate_speculative(params.target, parse_drafter("mlp_speculator", "chain:3"), params.drafter_params,
                                  PROMPTS,
                                  max_new_tokens=4, eos_ids=())


# ----------------------------------------------------------------------------- in the loop




@pytest.mark.slow
def test_full_tree_accepts_every_depth():
    """Vocabulary 4, tree:4,4: every token sits under every depth-1 node, so the target's two next
    tokens are always in the tree and every pass emits 3 (the last may be clipped)."""
    spec, tp, params = setup(4, n_predict=2)
    prompts = [[t % 4 for t in p] for p in PROMPTS]
    sp = loop.generate_speculative(params.target, parse_drafter("mlp_speculator", "tree:4,4"), params.drafter_params,
                                   prompts,
                                   max_new_tokens=25, eos_ids=())
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=25, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log, passes = np.asarray(sp.accept_log_bi), np.asarray(sp.n_passes_b)
    for b in range(2):
        assert np.all(log[b, : passes[b] - 1] == 3), log[b, : passes[b]]


def _target_argmax_speculator(tp, d, vocab):
    """One stage whose top-1 is exactly the target's own next-token argmax at p: D = 2d, proj.0 = [I | -I],
    emb = 0, LN scale 1 / shift 0, head = [E; -E]^T (E the tied embedding). s = GELU([h, -h] / rms(h)), and
    GELU(x) - GELU(-x) = x, so the logits are (h / rms(h)) E^T: the target's logits scaled by 1/rms > 0."""
    c = ms.make_config(1, d, vocab, inner_dim=2 * d)
    e = np.asarray(tp["embed"]["embedding"], np.float32)  # [V, d]
    eye = np.eye(d, dtype=np.float32)
    return {"proj_in": {"kernel": np.concatenate([eye, -eye], axis=1)},
            "proj": {"kernel": np.zeros((0, 2 * d, 2 * d), np.float32)},
            "emb": {"embedding": np.zeros((1, vocab, 2 * d), np.float32)},
            "ln": {"scale": np.ones((1, 2 * d), np.float32), "bias": np.zeros((1, 2 * d), np.float32)},
            "lm_head": {"kernel": np.concatenate([e.T, -e.T], axis=0)[None]}}, c


@pytest.mark.slow
def test_state_follows_the_last_accepted_node():
    """The stage above drafts, from h[p], the target's argmax at p — the root x[p+1] itself — so it is
    right only if the state is the target's hidden state at the last accepted position: chain:1 is
    then accepted exactly where the greedy text repeats a token (x[p+2] == x[p+1])."""
    spec, tp, _ = make("eagle3", 4)
    p, c = _target_argmax_speculator(tp, spec.target.d_model, 4)
    assert ms.config_of(p) == c
    params = own(spec, tp, {"mlp_speculator": p})
    prompts = [[t % 4 for t in q] for q in PROMPTS]
    sp = loop.generate_speculative(params.target, parse_drafter("mlp_speculator", "chain:1"), params.drafter_params,
                                   prompts,
                                   max_new_tokens=20, eos_ids=())
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=20, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    n_repeats = 0
    for b, row in enumerate(generated_rows(ar, 2)):
        i, want = 0, []  # replay: a pass rooted at x_i accepts the draft (= x_i) iff x_{i+1} == x_i
        while i + 1 < len(row):
            n = 2 if row[i + 1] == row[i] else 1
            want.append(n)
            i += n
        n_repeats += want.count(2)
        got = np.asarray(sp.accept_log_bi)[b, : int(np.asarray(sp.n_passes_b)[b])].tolist()
        assert got[: len(want) - 1] == want[: len(want) - 1], (row, got, want)
    assert n_repeats > 0  # the replay saw accepted drafts


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2", "tree:2,2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, n_predict=2, seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    drafter = parse_drafter("mlp_speculator", plan)
    assert_sampling_is_lossless(spec, tp, params, drafter)


# ----------------------------------------------------------------------------- import / export


@pytest.mark.slow
def test_published_format_round_trip(tmp_path):
    import ml_dtypes
    import torch

    from confu_jax.decode.families import decode_head
    from confu_jax.weights.mlp_speculator_format import (is_mlp_speculator_dir, load_mlp_speculator_dir,
                                                         save_mlp_speculator_dir)
    from confu_jax.weights.safetensors_io import SafetensorsFile, save_file

    spec, tp, params = setup(6)
    p = params.drafter_params.weights["mlp_speculator"]
    d = str(tmp_path / "untied")
    save_mlp_speculator_dir(d, p)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert {k: cfg[k] for k in ("model_type", "n_predict", "emb_dim", "inner_dim", "vocab_size", "tie_weights",
                                "scale_input", "top_k_tokens_per_head")} == {
        "model_type": "mlp_speculator", "n_predict": 3, "emb_dim": spec.target.d_model, "inner_dim": 32,
        "vocab_size": 6, "tie_weights": False, "scale_input": False, "top_k_tokens_per_head": [5, 4, 3]}
    names = set(SafetensorsFile(os.path.join(d, "model.safetensors")).names())
    assert names == {"speculator." + k for k in ms.to_reference_state_dict(p)}  # the HF wrapper's prefix
    assert is_mlp_speculator_dir(d)
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_mlp_speculator_dir(d).params, p)
    # tied + scale_input: every stage's keys, or only the shared ones (HF's save drops shared duplicates)
    pt, ct = speculator_for(spec.target.d_model, 6, 3, 32, tie_weights=True, scale_input=True)
    dt = str(tmp_path / "tied")
    save_mlp_speculator_dir(dt, pt, dtype=ml_dtypes.bfloat16)
    with open(os.path.join(dt, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["tie_weights"] is True and cfg["scale_input"] is True and cfg["torch_dtype"] == "bfloat16"
    bf = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), pt)
    bf["ln0"] = pt["ln0"]  # not stored: the reference's ln0 has no parameters
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_mlp_speculator_dir(dt).params, bf)
    sd = ms.to_reference_state_dict(pt)
    shared = {k: v for k, v in sd.items() if k.split(".")[1] == "0" or k == "proj.1.weight"}
    save_file(shared, os.path.join(dt, "model.safetensors"))
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_mlp_speculator_dir(dt).params, pt)
    bad = dict(shared, **{"emb.2.weight": sd["emb.2.weight"] + 1})
    save_file(bad, os.path.join(dt, "model.safetensors"))
    with pytest.raises(ValueError, match="'emb.2.weight' differs from the shared 'emb.0.weight'"):
        load_mlp_speculator_dir(dt)
    # pytorch_model.bin (torch.save of the module's state dict, no prefix)
    db = tmp_path / "bin"
    db.mkdir()
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in ms.to_reference_state_dict(p).items()},
               str(db / "pytorch_model.bin"))
    with open(db / "config.json", "w") as f:
        json.dump({"model_type": "mlp_speculator", "n_predict": 3, "emb_dim": spec.target.d_model, "inner_dim": 32,
                   "vocab_size": 6}, f)
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_mlp_speculator_dir(str(db)).params, p)
    # errors name what was expected
    with open(db / "config.json", "w") as f:
        json.dump({"model_type": "mlp_speculator", "n_predict": 3, "emb_dim": spec.target.d_model, "inner_dim": 16,
                   "vocab_size": 6}, f)
    with pytest.raises(ValueError, match="expected shape"):
        load_mlp_speculator_dir(str(db))
    sd = ms.to_reference_state_dict(p)
    del sd["ln.1.bias"]
    with pytest.raises(ValueError, match="missing keys \\['ln.1.bias'\\]"):
        ms.from_reference_state_dict(sd, ms.make_config(3, spec.target.d_model, 6, 32))
    # and it decodes through decode_head, losslessly and exactly as the in-memory stages
    head = decode_head("mlp_speculator", spec.target, tp, d)
    assert head.trained and "mlp_speculator format" in head.source
    drafter = parse_drafter("mlp_speculator", "tree:2,2")
    a = loop.generate_speculative(head.target, drafter, head.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    with pytest.raises(ValueError, match="neither an MLP speculator"):
        decode_head("mlp_speculator", spec.target, tp, str(tmp_path))


# ----------------------------------------------------------------------------- training

def _config(**extra):
    from configs.tiny_mlp_speculator import get_config
    from tests.helpers.train_resume import short_run_config

    return short_run_config(get_config, **extra)


@pytest.mark.slow
def test_loss_equals_hand_computation():
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.models.target import real_forward
    from confu_jax.train.loop import setup_run
    from confu_jax.train.mlp_speculator_task import mlp_speculator_loss
    from confu_jax.train.target_loading import load_target

    config = _config()
    run = setup_run(config)
    batch = next(run.task.train_iterator(0, 1))
    spec, tp = load_target(config, model_spec_from_config(config))
    p, c = speculator_for(spec.target.d_model, spec.target.vocab_size, 3, 16, tie_weights=True, scale_input=True)
    loss, m = jit_static(mlp_speculator_loss)(spec, p, tp, batch)
    toks = np.asarray(batch["tokens"])
    mask = np.asarray(batch["loss_mask"]).astype(bool)
    if "attention_mask" in batch:
        mask &= np.asarray(batch["attention_mask"]).astype(bool)
    h = np.asarray(jit_static(real_forward)(spec, tp, jnp.asarray(toks), return_logits=False).hidden_btd)
    bsz, n = toks.shape
    # the reference's teacher-forced forward, inds = x[1:] (padded: stage i at t reads x[t+i+1])
    inds = np.concatenate([toks[:, 1:], np.zeros((bsz, 4), toks.dtype)], axis=1)
    logits = _reference(p, c).forward(h, inds)  # [K, B, N, V]
    want = 0.0
    for i in range(3):
        lp = logits[i] - logits[i].max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nll, cnt = 0.0, 0
        for b in range(bsz):
            for t in range(n - i - 2):
                if mask[b, t + i + 2]:
                    nll -= lp[b, t, toks[b, t + i + 2]]
                    cnt += 1
        assert cnt > 0
        np.testing.assert_allclose(float(m[f"ce/head{i}"]), nll / cnt, rtol=1e-4)
        want += nll / cnt  # the reference sums the stages' losses unweighted
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    assert 1.0 <= float(m["acceptance_length"]) <= 4.0


@pytest.mark.slow
def test_training_lowers_the_loss_and_the_run_decodes(tmp_path):
    """A tied, input-scaled speculator (fms-fsdp's defaults): trained in the shared layout, restored and
    broadcast for decoding, exported and read back."""
    import ml_dtypes

    from confu_jax.decode.families import decode_head
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.mlp_speculator import export_mlp_speculator_run, is_mlp_speculator_workdir
    from confu_jax.train.loop import train
    from confu_jax.train.target_loading import load_target
    from confu_jax.weights.mlp_speculator_format import load_mlp_speculator_dir

    workdir = str(tmp_path / "mlp")
    config = _config(**{"train.steps": 40, "train.eval_every": 20, "train.checkpoint.every": 20,
                        "mlp_speculator.tie_weights": True, "mlp_speculator.scale_input": True,
                        "mlp_speculator.inner_dim": 32})
    result = train(config, workdir)
    assert result.step == 40
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.85 * first, (first, last)
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"]
    assert {"acc/head0", "acc/head2", "acceptance_length"} <= set(ev[-1])
    assert is_mlp_speculator_workdir(workdir)
    spec, tp = load_target(config, model_spec_from_config(config))
    head = decode_head("mlp_speculator", spec.target, tp, workdir)
    assert head.trained and "step 40" in head.source
    sp = head.drafter_params.weights["mlp_speculator"]
    assert ms.is_tied(sp) and ms.config_of(sp).scale_input and ms.config_of(sp).inner_dim == 32
    out = str(tmp_path / "exported")
    run = export_mlp_speculator_run(workdir, out, spec.target, tp, dtype="bfloat16")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_weights"] is True
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                                     run.params)
    rounded["ln0"] = run.params["ln0"]  # not stored: the reference's ln0 has no parameters
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_mlp_speculator_dir(out).params, rounded)
    assert decode_head("mlp_speculator", spec.target, tp, out).trained
    assert not decode_head("mlp_speculator", spec.target, tp, None).trained
    prompts = [[5, 9, 17, 3], [40, 2, 7, 7, 1, 30]]
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=16, eos_ids=())
    for plan in ("chain:3", "tree:2,2,1"):
        res = loop.generate_speculative(head.target, parse_drafter("mlp_speculator", plan), head.drafter_params,
                                        prompts,
                                        max_new_tokens=16, eos_ids=())
        assert generated_rows(res, 2) == generated_rows(ar, 2)
