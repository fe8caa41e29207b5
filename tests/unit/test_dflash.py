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
drafted block is the reference loop's, chi-square at T=1 against the exact joint (greedy = AR
for every plan shape and sharded = single device: tests/contract/test_family_contract.py); (3) the published layout round trip; (4) the loss equals a hand computation, a short run
lowers it and decodes losslessly, and a killed run resumes with identical losses.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop
from confu_jax.decode.dflash import DFlashDrafter, parse_dflash_plan
from confu_jax.decode.families import parse_drafter
from confu_jax.decode.generate import generate_ar
from confu_jax.models import dflash as D
from confu_jax.decode.families import get_method
from tests.helpers.dflash_reference import MASK, draft_for, first_block, setup, torch_reference  # noqa: F401
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.loop_fixtures import generated_rows, own
from tests.helpers.jitting import jit_static

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]
# the draft's pieces under jit (tests/helpers/jitting.py: called eagerly, every primitive compiles on its own)
(block_hidden, block_logits, context_features, context_kv, draft_blocks, embed_block, sequence_context) = (
    jit_static(f) for f in (D.block_hidden, D.block_logits, D.context_features, D.context_kv, D.draft_blocks,
                            D.embed_block, D.sequence_context))


def test_forward_equals_reference():
    import torch

    spec, tp, params = setup(24)
    dcfg, p = spec.draft_model, D.model_params(params.drafter_params.weights["dflash"])
    n_taps = len(spec.taps)
    ref = torch_reference(dcfg, n_taps, D.to_reference_state_dict(p))
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
    k, v = sequence_context(p, dcfg, jnp.asarray(taps), jnp.asarray(pos[:, :s]))
    got = block_hidden(p, dcfg, jnp.asarray(noise), jnp.asarray(pos[:, s:]), jnp.ones((b, bs, bs), bool), k, v,
                       jnp.full((b,), s))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    # the context committed through the cache helpers in two pieces gives the same block
    from confu_jax.models.kv_cache import commit, init_cache

    cache = init_cache(dcfg.n_layers, b, 16, dcfg.n_kv_heads, dcfg.head_dim)
    for lo, hi in ((0, 4), (4, s)):
        kk, vv = context_kv(p, dcfg, context_features(p, dcfg, jnp.asarray(taps[:, lo:hi])),
                            jnp.asarray(pos[:, lo:hi]))
        cache = jit_static(commit)(cache, kk, vv, jnp.full((b,), hi - lo))
    got2 = block_hidden(p, dcfg, jnp.asarray(noise), jnp.asarray(pos[:, s:]), jnp.ones((b, bs, bs), bool),
                        cache.k_lbhsd, cache.v_lbhsd, cache.length_b)
    np.testing.assert_allclose(np.asarray(got2), want, rtol=2e-4, atol=2e-4)
    # training blocks: anchors 2 and 5 of a row, each block sees the context before its anchor and itself
    tokens = rng.integers(0, 24, (b, s))
    anchors = np.array([[2, 5], [1, 4]])
    h = draft_blocks(p, dcfg, spec.target, tp, jnp.asarray(taps), jnp.asarray(tokens), jnp.asarray(anchors), MASK,
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
    assert d.describe() == "tree:2,2,1" and d.rule(True).name == "greedy"
    assert parse_drafter("dflash", "chain:15").plan.k == 15
    assert parse_drafter("dflash", "sampled_chain:2").rule(False).name == "sampled_chain"
    dd = parse_drafter("dflash", "ddtree:30,8")  # DDTree: 30 nodes below the root, at most 8 deep
    assert (dd.n_nodes, dd.max_depth, dd.describe(), dd.rule(False).name) == (31, 8, "ddtree:30,8", "sampled_tree")
    with pytest.raises(ValueError, match="contemplates"):
        parse_dflash_plan("chain:3+c2")
    assert get_method("dflash").needs_head and get_method("dflash").speculative
    spec, tp, _ = setup(6)
    with pytest.raises(ValueError, match="needs drafter_params.weights\\['dflash'\\]"):
        empty = own(spec, tp, {})
        loop.generate_speculative(empty.target, parse_drafter("dflash", "chain:2"), empty.drafter_params, PROMPTS,
                                  max_new_tokens=4, eos_ids=())


# ----------------------------------------------------------------------------- in the loop


def test_block_is_the_reference_loop():
    """The first proposal is the reference's first block: [root, M, M, M] at positions n..n+3 over the
    prompt's taps (every context slot visible), each drafted token the argmax of its own position."""
    spec, tp, params = setup(24, seed=1)
    drafter = parse_drafter("dflash", "chain:3")
    prop, root, logits = first_block(spec, tp, params, drafter, [3, 9, 4, 17, 3, 9])
    chain = np.asarray(prop.tree.tokens_bt)[0].tolist()
    want = np.argmax(logits, -1)
    assert chain == [root] + want.tolist()
    # a tree's depth-d nodes are position d's top-k, the same under every parent
    prop, _, _ = first_block(spec, tp, params, drafter.__class__(parse_dflash_plan("tree:2,2")), [3, 9, 4, 17, 3, 9])
    toks, par = np.asarray(prop.tree.tokens_bt)[0], np.asarray(prop.tree.parents_bt)[0]
    kids = [sorted(int(toks[j]) for j in range(len(toks)) if par[j] == i) for i in (1, 2)]
    assert kids[0] == kids[1] and len(kids[0]) == 2




@pytest.mark.slow
@pytest.mark.parametrize("plan", ["sampled_chain:2", "ddtree:4,2"])
def test_sampling_lossless_joint(plan):
    spec, tp, params = setup(4, seed=3, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    drafter = parse_drafter("dflash", plan)
    assert_sampling_is_lossless(spec, tp, params, drafter)


# ----------------------------------------------------------------------------- import / export


@pytest.mark.slow
def test_published_layout_round_trip(tmp_path):
    import ml_dtypes

    from confu_jax.decode.families import decode_head
    from confu_jax.weights.dflash_format import is_dflash_dir, load_dflash_dir, save_dflash_dir
    from confu_jax.weights.safetensors_io import SafetensorsFile, save_file

    spec, tp, params = setup(6)
    dcfg, p = spec.draft_model, D.model_params(params.drafter_params.weights["dflash"])
    d = str(tmp_path / "dflash")
    save_dflash_dir(d, p, dcfg, taps=spec.taps, mask_token_id=MASK, block_size=4,
                    num_target_layers=spec.target.n_layers)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": D.layer_ids_for_taps(spec.taps)}
    assert (c["block_size"], c["num_target_layers"], c["num_hidden_layers"], c["rope_theta"]) == (
        4, spec.target.n_layers, 2, 50000.0)
    f = SafetensorsFile(os.path.join(d, "model.safetensors"))
    assert set(f.names()) == set(D.to_reference_state_dict(p))
    assert "layers.1.self_attn.k_norm.weight" in set(f.names())
    np.testing.assert_array_equal(f.get("fc.weight"), np.asarray(p["fc"]["kernel"]).T)  # torch [out, in]
    assert is_dflash_dir(d) and not is_dflash_dir(str(tmp_path))
    imp = load_dflash_dir(d)
    assert (imp.mask_token_id, imp.block_size, imp.taps, imp.draft.rms_eps) == (MASK, 4, spec.taps, 1e-6)
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, p)
    # bf16, with the HF "model." prefix some exports carry: rounded values back
    db = str(tmp_path / "bf16")
    save_dflash_dir(db, p, dcfg, taps=spec.taps, mask_token_id=MASK, block_size=4,
                    num_target_layers=spec.target.n_layers, dtype=ml_dtypes.bfloat16)
    fb = SafetensorsFile(os.path.join(db, "model.safetensors"))
    sd = {f"model.{k}": np.array(fb.get(k)) for k in fb.names()}
    save_file(sd, os.path.join(db, "model.safetensors"))
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), p)
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_dflash_dir(db).params, rounded)
    # decode_head: the spec carries the draft's config and taps; it decodes exactly as the in-memory draft
    head = decode_head("dflash", spec.target, tp, d)
    assert head.trained and head.spec.draft_model.n_layers == 2 and head.spec.taps == spec.taps
    drafter = parse_drafter("dflash", "chain:3")
    a = loop.generate_speculative(head.target, drafter, head.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=12, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    with pytest.raises(ValueError, match="cannot read a target of width"):
        decode_head("dflash", spec.target.replace(d_model=32, n_heads=2, n_kv_heads=1), tp, d)
    with pytest.raises(ValueError, match="neither a DFlash"):
        decode_head("dflash", spec.target, tp, str(tmp_path))
    assert not decode_head("dflash", spec.target, tp, None).trained
    # the block bounds a plan's depth: a block of 4 holds the root and 3 masks
    from confu_jax.decode.families import drafter_for

    assert drafter_for("dflash", None, head).max_depth == 3 and drafter_for("dflash", "ddtree:6,3", head).n_nodes == 7
    for deep in ("chain:4", "ddtree:6"):
        with pytest.raises(ValueError, match=f"plan '{deep}' drafts \\d+ deep; .* at most 3 deep"):
            drafter_for("dflash", deep, head)
    assert drafter_for("dflash", "chain:9", decode_head("dflash", spec.target, tp, None)).max_depth == 9  # untrained


@pytest.mark.slow
def test_five_tap_drafter_imports_and_decodes(tmp_path):
    """z-lab's 8B drafters read 5 target layers (build_target_layer_ids(L, 5)): one in their layout,
    on the 8-layer tiny target, imports with its 5 taps and decodes exactly as AR and as in memory."""
    from confu_jax.decode.families import decode_head
    from confu_jax.weights.dflash_format import save_dflash_dir

    spec, tp, _ = setup(6)
    taps = D.default_taps(spec.target.n_layers, 5)
    assert len(taps) == 5 and max(taps) < spec.target.n_layers
    spec = dataclasses.replace(spec, head=None, tap_layers=taps)  # the drafter's own taps (DrafterParams.tap_layers)
    p = draft_for(spec.draft_model, 5, seed=1)
    assert np.asarray(p["fc"]["kernel"]).shape == (5 * spec.target.d_model, spec.target.d_model)
    params = own(spec, tp, {"dflash": {**p, "mask_token_id": np.int32(MASK)}})
    d = str(tmp_path / "dflash5")
    save_dflash_dir(d, D.model_params(p), spec.draft_model, taps=taps, mask_token_id=MASK, block_size=4,
                    num_target_layers=spec.target.n_layers)
    head = decode_head("dflash", spec.target, tp, d)
    assert head.spec.taps == taps
    drafter = parse_drafter("dflash", "chain:3")
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=20, eos_ids=())
    a = loop.generate_speculative(head.target, drafter, head.drafter_params, PROMPTS, max_new_tokens=20, eos_ids=())
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=20, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(ar, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    # a drafter reading the target's last layer's output (no tap exists after it) is refused, naming the ids
    save_dflash_dir(d, D.model_params(p), spec.draft_model, taps=taps[:4] + (spec.target.n_layers,),
                    mask_token_id=MASK, block_size=4, num_target_layers=spec.target.n_layers)
    with pytest.raises(ValueError, match="target_layer_ids"):
        decode_head("dflash", spec.target, tp, d)


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
def test_the_smollm2_target_keeps_the_draft_model():
    """Loading a real checkpoint replaces the preset's target config and keeps the spec's draft model
    (SmolLM2's DFlash run once failed at init: the loaded spec had lost it; the tiny target, random
    weights, never went through that path)."""
    from configs.smollm2_dflash import get_config
    from confu_jax.train.dflash_task import dflash_spec
    from confu_jax.train.target_loading import load_target

    config = get_config()
    spec = dflash_spec(config)
    loaded, params = load_target(config, spec)
    assert loaded.draft_model == spec.draft_model and loaded.draft_model.n_layers == 3
    assert loaded.taps == spec.taps and loaded.target.n_layers == spec.target.n_layers == 30
    assert jax.tree_util.tree_leaves(params["embed"])[0].shape[0] == loaded.target.vocab_size

def _config(**extra):
    from configs.tiny_dflash import get_config
    from tests.helpers.train_resume import short_run_config

    return short_run_config(get_config, **extra)


@pytest.mark.slow
def _dpace_by_hand(q, valid, alpha, loss_type):
    """SpecForge's D-PACE weights of one block, position by position (loops, no array algebra)."""
    s = [(1 - alpha) * qk + alpha if v else 1.0 for qk, v in zip(q, valid)]
    prefix = [float(np.prod(s[:k + 1])) for k in range(len(s))]
    suffix = [sum(prefix[j] for j in range(k, len(s)) if valid[j]) for k in range(len(s))]
    return {"dpace": suffix, "dpace-cumulative-confidence-only": prefix,
            "dpace-continuation-value-only": [a / b for a, b in zip(suffix, prefix)]}[loss_type]


@pytest.mark.parametrize("loss_type", ["dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"])
def test_dpace_weights_are_the_loops(loss_type):
    from confu_jax.train.dflash_task import dpace_weights

    rng = np.random.default_rng(0)
    q = rng.uniform(size=(3, 4, 6)).astype(np.float32)
    valid = rng.uniform(size=(3, 4, 6)) < 0.7
    valid[..., 0] = False  # the anchor position is never trained
    got = np.asarray(dpace_weights(jnp.asarray(q), jnp.asarray(valid), 0.3, loss_type))
    want = np.array([[_dpace_by_hand(q[i, j], valid[i, j], 0.3, loss_type) for j in range(4)] for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # no gradient flows through the weights: they scale the CE, they are not trained
    g = jax.grad(lambda x: dpace_weights(x, jnp.asarray(valid), 0.3, loss_type).sum())(jnp.asarray(q))
    assert not np.asarray(g).any()


def test_loss_equals_hand_computation():
    """SpecForge's block objective recomputed block by block: anchors = the rng's uniform draw among the t
    with x[t], x[t+1] answer tokens; each block alone over the context before its anchor; CE of position
    k >= 1 against x[a+k] where that is an answer token, weighted exp(-(k-1)/γ). D-PACE on the same blocks:
    each CE weighted by the block's own D-PACE weights, summed, over the batch's rows."""
    from confu_jax.train.dflash_task import dflash_loss, dflash_spec
    from confu_jax.train.loop import setup_run
    from confu_jax.train.loss import sample_anchors
    from confu_jax.train.target_loading import load_target
    from confu_jax.models.target import real_forward

    config = _config()
    run = setup_run(config)
    batch = next(run.task.train_iterator(0, 1))
    spec, tp = load_target(config, dflash_spec(config))
    dcfg = spec.draft_model
    p = draft_for(dcfg, len(spec.taps), seed=2, std=0.2)
    bs, n_anchor, gamma, mask_id = 4, 5, 4.0, 127
    rng = jax.random.PRNGKey(7)
    loss, metrics = jit_static(dflash_loss)(spec, p, tp, batch, rng, block_size=bs, num_anchors=n_anchor,
                                            mask_token_id=mask_id, gamma=gamma)
    dpace, _ = jit_static(dflash_loss)(spec, p, tp, batch, rng, block_size=bs, num_anchors=n_anchor,
                                       mask_token_id=mask_id, gamma=gamma, loss_type="dpace", dpace_alpha=0.5)
    toks = np.asarray(batch["tokens"])
    mask = np.asarray(batch["loss_mask"]).astype(bool)
    if "attention_mask" in batch:
        mask &= np.asarray(batch["attention_mask"]).astype(bool)
    b, n = toks.shape
    cand = mask & np.r_["1", mask[:, 1:], np.zeros((b, 1), bool)]
    anchors, valid = (np.asarray(x) for x in jit_static(sample_anchors)(rng, jnp.asarray(cand), n_anchor))
    assert valid.sum() > 0 and np.all(cand[np.arange(b)[:, None], anchors][valid])
    taps = jit_static(real_forward)(spec, tp, jnp.asarray(toks), return_logits=False).taps_btc
    k_ctx, v_ctx = sequence_context(p, dcfg, taps)
    num = den = dpace_num = 0.0
    per_pos = {i: [] for i in range(1, bs)}
    for r in range(b):
        for j in np.flatnonzero(valid[r]):
            a = int(anchors[r, j])
            blk = jnp.asarray([[toks[r, a]] + [mask_id] * (bs - 1)])
            h = block_hidden(p, dcfg, embed_block(tp, blk), jnp.arange(a, a + bs)[None],
                             jnp.ones((1, bs, bs), bool), k_ctx[:, r:r + 1], v_ctx[:, r:r + 1], jnp.array([a]))
            lp = np.asarray(jax.nn.log_softmax(block_logits(spec.target, tp, h), -1))[0]
            trained = [i > 0 and a + i < n and bool(mask[r, a + i]) for i in range(bs)]
            nll_k = [-lp[i, toks[r, min(a + i, n - 1)]] for i in range(bs)]
            wd = _dpace_by_hand(np.exp(-np.asarray(nll_k)), trained, 0.5, "dpace")
            for i in range(1, bs):
                if trained[i]:
                    w = np.exp(-(i - 1) / gamma)
                    num += w * nll_k[i]
                    den += w
                    dpace_num += wd[i] * nll_k[i]
                    per_pos[i].append(nll_k[i])
    np.testing.assert_allclose(float(loss), num / den, rtol=2e-4)
    np.testing.assert_allclose(float(dpace), dpace_num / b, rtol=2e-4)
    for i in range(1, bs):
        np.testing.assert_allclose(float(metrics[f"ce/head{i - 1}"]), np.mean(per_pos[i]), rtol=2e-4)
    assert 1.0 <= float(metrics["acceptance_length"]) <= bs


@pytest.mark.slow
def test_training_lowers_the_loss_and_the_run_decodes(tmp_path):
    import ml_dtypes

    from confu_jax.decode.families import decode_head
    from confu_jax.runs.dflash import export_dflash_run, is_dflash_workdir
    from confu_jax.train.dflash_task import dflash_spec
    from confu_jax.train.loop import train
    from confu_jax.train.metric_writers import read_csv
    from confu_jax.train.target_loading import load_target
    from confu_jax.weights.dflash_format import load_dflash_dir

    workdir = str(tmp_path / "dflash")
    config = _config(**{"train.steps": 30, "train.eval_every": 15, "train.checkpoint.every": 15})
    assert train(config, workdir).step == 30
    rows = read_csv(os.path.join(workdir, "metrics.csv"))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.95 * first, (first, last)  # block drafting sees no drafted token: slower than MTP
    ev = read_csv(os.path.join(workdir, "eval.csv"))
    assert ev[-1]["loss"] < ev[0]["loss"]
    assert {"acc/head0", "acc/head2", "acceptance_length"} <= set(ev[-1])
    assert is_dflash_workdir(workdir)
    spec, tp = load_target(config, dflash_spec(config))
    head = decode_head("dflash", spec.target, tp, workdir)
    assert head.trained and "step 30" in head.source and head.spec.taps == spec.taps
    out = str(tmp_path / "exported")
    run = export_dflash_run(workdir, out, spec.target, tp, dtype="bfloat16")
    imp = load_dflash_dir(out)
    assert (imp.mask_token_id, imp.block_size, imp.taps) == (127, 4, spec.taps)
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                                     run.params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, imp.params, rounded)
    prompts = [[5, 9, 17, 3], [40, 2, 7, 7, 1, 30]]
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=16, eos_ids=())
    res = loop.generate_speculative(head.target, parse_drafter("dflash", "chain:3"), head.drafter_params, prompts,
                                    max_new_tokens=16, eos_ids=())
    assert generated_rows(res, 2) == generated_rows(ar, 2)
