"""Independent draft models and the early-exit self-drafter (``decode.draft_model``).

(1) The early-exit drafter's forward is the target's forward cut after N layers (the hidden
state entering layer N, then the target's final norm and LM head), on both parameter layouts;
(2) with N = all layers the self-drafter *is* the target, so greedy drafts are always accepted:
every pass emits the whole chain / the tree's deepest path (checks the draft cache, positions,
the uncommitted chain slots and the tree recomputation); (3) in the loop, greedy output equals AR
token for token (chain, sampled chain, static and dynamic trees, early exit and an independent
model of another shape, SD² steered with non-zero steering; batch of 2 with different prompt
lengths, EOS inside a draft); sampled output passes the chi-square test against the exact joint;
a sharded independent draft model of another shape equals the single-device one (the early-exit
drafter: tests/contract/test_family_contract.py); (4) a draft model with another tokenizer is refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import loop, plans
from confu_jax.decode import draft_model as dm
from confu_jax.decode.generate import generate_ar
from confu_jax.models import early_exit, steering as steer_lib
from confu_jax.runs import draft_models
from confu_jax.models.llama import Llama, param_shapes
from confu_jax.models.spec import ModelSpec
from confu_jax.models.unrolled import split_layers
from tests.helpers.model_fakes import _fill
from tests.helpers.family_checks import assert_sampling_is_lossless, assert_sharded_equals_single_device
from tests.helpers.loop_fixtures import generated_rows, make, own, with_weights

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]


def pair(vocab, *, early=None, other=None, steered_std=None, seed=0, **target_kw):
    """(spec, target params, LoadedDrafter) of the tiny target with a draft model: the early-exit
    drafter of ``early`` layers, or an independent random Llama ``other`` (a LlamaConfig);
    ``steered_std``: add SD² steering params (W_s ~ N(0, std); None = no steering tree)."""
    spec, tp, _ = make("eagle3", vocab, seed=seed, **target_kw)
    if other is None:
        dcfg, draft = early_exit.early_exit_config(spec.target, early), {}
    else:
        dcfg = other.replace(vocab_size=other.vocab_size or vocab)
        draft = {"model": _fill(param_shapes(dcfg), np.random.default_rng(seed + 7), 0.1, {})}
    if steered_std is not None:
        st = steer_lib.init_steering(spec.target.d_model, 3, dcfg)
        w_s = np.random.default_rng(seed + 11).standard_normal(st["w_s"]["kernel"].shape) * steered_std
        draft["steering"] = {"w_hml": st["w_hml"], "w_s": {"kernel": jnp.asarray(w_s, jnp.float32)}}
    spec = ModelSpec(spec.target, spec.head, draft_model=dcfg)
    return spec, tp, own(spec, tp, draft)


def other_model(vocab, **kw):
    from confu_jax.models.presets import get_preset

    base = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48,
                eos_token_ids=())
    base.update(kw)
    return get_preset("tiny").replace(**base)


# ----------------------------------------------------------------------------- the model


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_early_exit_equals_truncated_target(split):
    spec, tp, params = pair(24, early=3)
    toks = jnp.asarray([[3, 5, 7, 2, 9, 1]], jnp.int32)
    pos = jnp.arange(6)[None]
    target = params.target if not split else params.target.replace(params=split_layers(tp, spec.target))
    cfg, w = dm.draft_weights(target, params.drafter_params)
    got = dm.logits(cfg, w, dm.forward(cfg, w, toks, pos).hidden_btd, spec.target.vocab_size)
    model = Llama(spec.target)
    entering = model.apply({"params": tp}, toks, pos, tap_layers=(3,), return_logits=False).taps_btc
    want = model.apply({"params": tp}, entering, method=lambda m, x: m.logits(m.final_norm(x)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # a different depth is a different model
    cfg2, w2 = dm.draft_weights(params.target, params.drafter_params.replace(
        draft_model=early_exit.early_exit_config(spec.target, 2)))
    assert not np.allclose(np.asarray(dm.logits(cfg2, w2, dm.forward(cfg2, w2, toks, pos).hidden_btd, 24)),
                           np.asarray(got))


@pytest.mark.slow
def test_mlp_bias_zero_is_no_bias_and_unrolled_matches():
    spec, tp, _ = pair(24, early=2)
    cfg = spec.target
    toks = jnp.asarray([[3, 5, 7, 2], [1, 1, 2, 0]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
    model = Llama(cfg)
    plain = model.apply({"params": tp}, toks, pos)
    zero = model.apply({"params": tp}, toks, pos, mlp_bias_lbtf=jnp.zeros((cfg.n_layers, 2, 1, cfg.ffn_dim)))
    np.testing.assert_array_equal(np.asarray(plain.logits_btv), np.asarray(zero.logits_btv))
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((cfg.n_layers, 2, 4, cfg.ffn_dim)), jnp.float32)
    scanned = model.apply({"params": tp}, toks, pos, mlp_bias_lbtf=bias)
    unrolled = dm.apply_target(split_layers(tp, cfg), cfg, toks, pos, mlp_bias_lbtf=bias)
    assert not np.allclose(np.asarray(scanned.logits_btv), np.asarray(plain.logits_btv))
    np.testing.assert_allclose(np.asarray(unrolled.logits_btv), np.asarray(scanned.logits_btv), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mlp_bias_lbtf must be"):
        model.apply({"params": tp}, toks, pos, mlp_bias_lbtf=bias[:, :, :2])


# ----------------------------------------------------------------------------- in the loop


FULL_TREE = plans.StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["chain:3", "sampled_chain:2", "dynamic:3,1,3", FULL_TREE],
                         ids=["chain:3", "sampled_chain:2", "dynamic:3,1,3", "static"])
def test_full_depth_self_drafter_is_always_accepted(plan):
    """The self-drafter with all the target's layers drafts the target's own greedy tokens (trees
    that hold the top-1 path: the static tree's (0, 0, 0), EAGLE-2 with top_k 1)."""
    spec, tp, params = pair(24, early=8)
    drafter = dm.DraftModel(plan if isinstance(plan, plans.DraftPlan) else plans.parse_plan(plan))
    sp = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=25,
                                   eos_ids=())
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=25, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log, passes = np.asarray(sp.accept_log_bi), np.asarray(sp.n_passes_b)
    full = drafter.max_depth + 1
    for b in range(2):
        row = log[b, : passes[b]]
        assert np.all(row[:-1] == full), row  # the last pass may be clipped by max_new_tokens


DRAFTERS = [
    ("early3", "chain:3", False),
    ("early3", "dynamic:3,2,5", False),
    ("other", "chain:4", False),
    ("other", "dynamic:2,3,6", False),
    ("early2", "chain:3", True),
    ("other", "dynamic:3,2,5", True),
]


def _pair_for(which, vocab, steered, **kw):
    if which.startswith("early"):
        return pair(vocab, early=int(which[5:]), steered_std=0.5 if steered else None, **kw)
    return pair(vocab, other=other_model(vocab), steered_std=0.5 if steered else None, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("which,plan,steered", DRAFTERS, ids=[f"{w}-{p}{'-sd2' if s else ''}" for w, p, s in DRAFTERS])
def test_greedy_equals_ar(which, plan, steered):
    spec, tp, params = _pair_for(which, 6, steered)
    drafter = dm.DraftModel(plans.parse_plan(plan), steered=steered)
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=())
    sp = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=30,
                                   eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log = np.asarray(sp.accept_log_bi)
    assert np.array_equal(log.sum(1) + 1, np.asarray(sp.n_generated_b))
    assert np.max(log) > 1  # drafts were accepted, not just lossless
    # EOS inside a draft: rows stop at different times
    eos = generated_rows(ar, 2)[0][11]
    ar_e = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=(eos,))
    sp_e = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=30,
                                     eos_ids=(eos,))
    assert generated_rows(sp_e, 2) == generated_rows(ar_e, 2)
    assert np.array_equal(np.asarray(sp_e.stop_reason_b), np.asarray(ar_e.stop_reason_b))


@pytest.mark.slow
def test_zero_steering_equals_unsteered():
    """W_s = 0 (the paper's initialisation): the steered drafter proposes exactly what the plain
    one does — same tokens and the same accepted lengths pass for pass, greedy (an early-exit chain)
    and sampled (another model's tree). One temperature per drafter: each case compiles the whole
    loop twice, and the greedy and sampled paths share the steering code."""
    for which, plan, temp in (("early3", "chain:3", 0.0), ("other", "dynamic:3,2,5", 1.0)):
        spec, tp, params = _pair_for(which, 24, False)
        cfg = spec.draft_model
        steered = with_weights(params, steering=steer_lib.init_steering(spec.target.d_model, 3, cfg))
        kw = dict(max_new_tokens=20, eos_ids=(), temperature=temp, seed=3)
        a = loop.generate_speculative(params.target, dm.DraftModel(plans.parse_plan(plan)), params.drafter_params,
                                      PROMPTS, **kw)
        b = loop.generate_speculative(steered.target, dm.DraftModel(plans.parse_plan(plan), steered=True),
                                      steered.drafter_params,
                                      PROMPTS, **kw)
        assert generated_rows(a, 2) == generated_rows(b, 2)
        np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))
    # and non-zero steering changes what is drafted (so the test above is not vacuous)
    spec, tp, params = _pair_for("early3", 24, True)
    plain = params._replace(drafter_params=params.drafter_params.replace(weights={}))
    a = loop.generate_speculative(plain.target, dm.DraftModel(plans.parse_plan("chain:3")), plain.drafter_params,
                                  PROMPTS,
                                  max_new_tokens=20, eos_ids=())
    b = loop.generate_speculative(params.target, dm.DraftModel(plans.parse_plan("chain:3"), steered=True),
                                  params.drafter_params, PROMPTS,
                                  max_new_tokens=20, eos_ids=())
    assert generated_rows(a, 2) == generated_rows(b, 2)
    assert not np.array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))


@pytest.mark.slow
@pytest.mark.parametrize("which,plan,steered", [("other", "sampled_chain:2", False), ("early2", "dynamic:2,2,4", False),
                                                ("early2", "sampled_chain:2", True)])
def test_sampling_lossless_joint(which, plan, steered):
    kw = dict(seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    spec, tp, params = _pair_for(which, 4, steered, **kw)
    drafter = dm.DraftModel(plans.parse_plan(plan), steered=steered)
    assert_sampling_is_lossless(spec, tp, params, drafter)


@pytest.mark.slow
def test_sharded_draft_model_equals_single_device():
    prompts = PROMPTS * 2
    # the early-exit drafters (families draft_model and sd2) are sharded in tests/contract/test_family_contract.py
    spec, tp, params = _pair_for("other", 6, True)
    drafter = dm.DraftModel(plans.parse_plan("dynamic:3,2,5"), steered=True)
    assert_sharded_equals_single_device(params.target, params.drafter_params, drafter, prompts, same_accepts=False)


@pytest.mark.slow
def test_stacked_and_unrolled_loops_agree():
    spec, tp, params = _pair_for("other", 6, True)
    drafter = dm.DraftModel(plans.parse_plan("chain:3"), steered=True)
    a = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=16,
                                  eos_ids=(), unroll_layers=True)
    b = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=16,
                                  eos_ids=(), unroll_layers=False)
    assert generated_rows(a, 2) == generated_rows(b, 2)
    np.testing.assert_array_equal(np.asarray(a.accept_log_bi), np.asarray(b.accept_log_bi))


def test_drafter_refuses_bad_setups():
    spec, tp, params = pair(6, early=2)
    with pytest.raises(ValueError, match="no contemplates"):
        dm.DraftModel(plans.parse_plan("chain:3+c2"))
    with pytest.raises(ValueError, match="needs drafter_params.weights\\['steering'\\]"):
        loop.generate_speculative(params.target, dm.DraftModel(plans.parse_plan("chain:2"), steered=True),
                                  params.drafter_params, PROMPTS,
                                  max_new_tokens=4, eos_ids=())
    no_draft = params.drafter_params.replace(draft_model=None)
    with pytest.raises(ValueError, match="have no draft model"):
        loop.generate_speculative(params.target, dm.DraftModel(plans.parse_plan("chain:2")), no_draft, PROMPTS,
                                  max_new_tokens=4, eos_ids=())
    with pytest.raises(ValueError, match="n_layers must be in"):
        early_exit.early_exit_config(spec.target, 9)
    assert early_exit.parse_self_source("self:3", spec.target) == 3 and early_exit.parse_self_source("x.gguf", spec.target) is None
    with pytest.raises(ValueError, match="expected self:N"):
        early_exit.parse_self_source("self:x", spec.target)


# ----------------------------------------------------------------------------- tokenizers


def _tokenizer(tokens):
    from tokenizers import Tokenizer, models

    from confu_jax.data.chat import ChatTokenizer

    return ChatTokenizer(Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])),
                         chat_template=None)


def test_tokenizer_mismatch_is_refused():
    base = ["<unk>", "a", "b", "c", "d"]
    draft_models.check_tokenizers(_tokenizer(base), _tokenizer(list(base)))  # same vocabulary: accepted
    with pytest.raises(draft_models.TokenizerMismatchError, match="vocabulary of 6 tokens, the target's has 5"):
        draft_models.check_tokenizers(_tokenizer(base), _tokenizer(base + ["e"]))
    with pytest.raises(draft_models.TokenizerMismatchError, match="id 2: target 'b' vs draft 'x'"):
        draft_models.check_tokenizers(_tokenizer(base), _tokenizer(["<unk>", "a", "x", "c", "d"]))


def test_independent_model_is_split_once_outside_the_loop():
    """``Drafter.prepare_params``: on the unrolled path the loop hands the target in split per layer,
    and an independent draft model's stack is split there once (outside the ``while_loop``);
    ``draft_weights`` then reads those buffers as they are instead of slicing the stack again."""
    from confu_jax.models.unrolled import SplitParams, split_layers

    for which, split_expected in (("other", True), ("early3", False)):
        spec, tp, params = _pair_for(which, 6, False)
        drafter = dm.DraftModel(plans.parse_plan("chain:3"))
        target, dp = params.target, params.drafter_params
        assert drafter.prepare_params(target, dp) is dp  # stacked path: nothing to lay out
        unrolled = target.replace(params=split_layers(target.params, spec.target))
        prepared = drafter.prepare_params(unrolled, dp)
        model = (prepared.weights or {}).get("model")
        assert isinstance(model, SplitParams) == split_expected
        if split_expected:
            assert dm.draft_weights(unrolled, prepared)[1] is model
            assert drafter.prepare_params(unrolled, prepared) is prepared  # idempotent
            np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(model.layers[1])[0]),
                                          np.asarray(jax.tree_util.tree_leaves(params.drafter_params.weights["model"]["layers"])[0][1]))
