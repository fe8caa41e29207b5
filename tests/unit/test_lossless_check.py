"""The greedy lossless check (bench/lossless.py): real mismatches fail with the target's margins,
numerical ties are told apart from them, and a bf16 speculative run passes on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.bench import lossless
from confu_jax.decode import loop, plans
from confu_jax.decode.generate import generate_ar
from confu_jax.models.llama import Llama
from confu_jax.models.presets import get_preset
from tests.helpers.model_fakes import tiny_params
from tests.helpers.loop_fixtures import make

PROMPT = [3, 17, 5, 40, 2, 9, 11]


def _untied_target(vocab=64):
    from confu_jax.models.spec import HeadConfig, ModelSpec

    cfg = get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=(), tie_embeddings=False)
    tp, _ = tiny_params(ModelSpec(cfg, HeadConfig(variant="eagle3", draft_vocab_size=vocab)), 3)
    return cfg, tp


def _ar(tp, cfg, n=12):
    res = generate_ar(tp, cfg, [PROMPT], max_new_tokens=n, eos_ids=())
    return np.asarray(res.tokens_bn)[0, : int(res.n_generated_b[0])].tolist()


def _full_forward_logits(tp, cfg, ids):
    """Reference: one cache-free forward over the whole context (no prefill/decode split)."""
    ids = jnp.asarray([ids], jnp.int32)
    out = Llama(cfg).apply({"params": tp}, ids, jnp.arange(ids.shape[1])[None])
    return np.asarray(out.logits_btv[0, -1], np.float64)


@pytest.mark.slow
def test_real_mismatch_fails_with_the_targets_margins():
    cfg, tp = _untied_target()
    ar = _ar(tp, cfg)
    pos = 5
    ref = _full_forward_logits(tp, cfg, PROMPT + ar[:pos])
    worst = int(np.argmin(ref))  # a clearly wrong token: the target's least likely
    spec = ar[:pos] + [worst] + ar[pos + 1:]
    d = lossless.divergence_margins(tp, cfg, PROMPT, ar, spec)
    assert (d.position, d.ar_token, d.spec_token) == (pos, ar[pos], worst)
    want = ref[ar[pos]] - ref[worst]
    np.testing.assert_allclose([d.gap_stepwise, d.gap_block], [want, want], rtol=1e-4, atol=1e-5)
    assert want > 0 and not d.numerical_tie
    res = lossless.compare_greedy(tp, cfg, [("q", 0)], [(PROMPT, ar)], [(PROMPT, spec)])
    assert res["lossless_greedy"] is False and res["n_mismatched_turns"] == 1 and res["n_numerical_ties"] == 0
    assert res["first_mismatch"]["question_id"] == "q" and res["first_mismatch"]["position"] == pos


def test_exact_tie_is_not_a_failure():
    """Give token j the LM-head column of AR's token at ``pos``: the two logits are equal there,
    so a program that picks j diverges on a tie, not on a bug."""
    cfg, tp = _untied_target()
    ar = _ar(tp, cfg)
    # argmax takes the first of equal maxima: with j > tok, AR keeps picking tok
    pos = next(i for i in range(2, len(ar)) if ar[i] < cfg.vocab_size - 1)
    tok = ar[pos]
    j = next(t for t in range(cfg.vocab_size - 1, tok, -1) if t not in ar)
    kernel = np.array(tp["lm_head"]["kernel"])
    kernel[:, j] = kernel[:, tok]
    tp = dict(tp, lm_head={"kernel": jnp.asarray(kernel)})
    assert _ar(tp, cfg) == ar
    spec = ar[:pos] + [j] + ar[pos + 1:]
    d = lossless.divergence_margins(tp, cfg, PROMPT, ar, spec)
    assert abs(d.gap_stepwise) <= d.tolerance and abs(d.gap_block) <= d.tolerance and d.numerical_tie
    res = lossless.compare_greedy(tp, cfg, [("q", 0)], [(PROMPT, ar)], [(PROMPT, spec)])
    assert res["lossless_greedy"] is True and res["n_numerical_ties"] == 1
    assert res["first_mismatch"]["numerical_tie"] is True


def test_length_difference_and_inherited_turns():
    cfg, tp = _untied_target()
    ar = _ar(tp, cfg)
    # a strict prefix: no margin explains a missing token
    res = lossless.compare_greedy(tp, cfg, [("q", 0)], [(PROMPT, ar)], [(PROMPT, ar[:-1])])
    assert res["lossless_greedy"] is False and res["first_mismatch"]["length_spec"] == len(ar) - 1
    # turn 2 with a different prompt is counted but inherits turn 1's verdict (here: equal -> no
    # analysis possible, the turn is a consequence, and turn 1 matched: nothing failed)
    other = PROMPT + [1]
    res = lossless.compare_greedy(tp, cfg, [("q", 0), ("q", 1)], [(PROMPT, ar), (PROMPT, ar)],
                                  [(PROMPT, ar), (other, ar[:3])])
    assert res["n_mismatched_turns"] == 1 and res["first_mismatch"] is None and res["lossless_greedy"]
    with pytest.raises(ValueError, match="turn counts differ"):
        lossless.compare_greedy(tp, cfg, [("q", 0)], [], [])


def test_tie_tolerance_per_dtype():
    assert lossless.tie_rtol(jnp.float32) < lossless.tie_rtol(jnp.float16) < lossless.tie_rtol(jnp.bfloat16)
    with pytest.raises(ValueError, match="int8"):
        lossless.tie_rtol(jnp.int8)


@pytest.mark.slow
@pytest.mark.parametrize("variant,plan", [("eagle3", "chain:3"), ("confu", "dynamic:3,3,8")])
def test_bf16_speculative_run_is_lossless_up_to_ties(variant, plan):
    """bf16 on CPU: AR and verification evaluate the target in different orders, so greedy outputs
    may diverge where the target's top two are within bf16 rounding; every divergence must be
    such a tie (and a random tiny target has many near-ties, so divergences do occur here)."""
    vocab = 256
    spec, tp, params = make(variant, vocab, dtype="bfloat16")
    tp = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, tp)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=rng.integers(3, 20)).tolist() for _ in range(8)]

    def rows(res):
        toks, n = np.asarray(res.tokens_bn), np.asarray(res.n_generated_b)
        return [toks[b, : n[b]].tolist() for b in range(len(prompts))]

    ar = rows(generate_ar(tp, spec.target, prompts, max_new_tokens=40, eos_ids=()))
    sp = rows(loop.generate_speculative(params.target, HeadDrafter(plans.parse_plan(plan)), params.drafter_params,
                                        prompts, max_new_tokens=40,
                                        eos_ids=()))
    res = lossless.compare_greedy(tp, spec.target, [(i, 0) for i in range(len(prompts))],
                                  list(zip(prompts, ar)), list(zip(prompts, sp)))
    assert res["lossless_greedy"], res
    assert res["n_numerical_ties"] == res["n_mismatched_turns"]
