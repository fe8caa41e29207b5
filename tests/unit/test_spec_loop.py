"""The speculative loop's core invariant: output distribution == the target's.

Greedy: token-for-token equality with the jitted AR loop (itself checked against a plain Python
loop of full forwards in test_generate.py and against transformers in test_generate_smollm2.py).
Sampling: the exact AR joint distribution of the first three tokens, computed by enumeration from
the target's own probabilities, against >= 100k speculative samples (chi-square).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode import loop, plans
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.stopping import StopReason
from tests.helpers.loop_fixtures import (PROMPTS, chi_square_pvalue, exact_joint, generated_rows, make, prompts_for,
                                         with_weights)


# vocab 24 with a random draft: most drafts are rejected. vocab 4 with a full 2-level tree
# (dynamic:2,4,20): the target's choice is always in the tree, so every pass accepts >= 3 tokens.
# ConFu with f in its first step (future_input, its map randomised: it starts at zero) drafts otherwise, and
# so does ConFu whose f is the contemplate's taps read through fc (future_taps).
@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,vocab,plan,head_kw",
    [("eagle3", 24, "chain:3", {}), ("confu", 24, "dynamic:3,3,8", {}),
     ("eagle3", 4, "dynamic:2,4,20", {}), ("confu", 4, "dynamic:2,4,20", {}),
     ("confu", 24, "chain:3", {"future_input": True}), ("confu", 24, "dynamic:3,3,8", {"future_taps": True})],
)
def test_greedy_lossless_batch(variant, vocab, plan, head_kw):
    spec, tp, params = make(variant, vocab, head_kw=head_kw)
    if head_kw.get("future_input"):
        d = spec.target.d_model
        params = with_weights(params, future_in={
            "kernel": 0.3 * jax.random.normal(jax.random.PRNGKey(5), (d, d), jnp.float32)})
    plan = HeadDrafter(plans.parse_plan(plan))
    prompts = prompts_for(vocab)
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=30, eos_ids=())
    sp = loop.generate_speculative(params.target, plan, params.drafter_params, prompts, max_new_tokens=30, eos_ids=())
    assert generated_rows(sp, 4) == generated_rows(ar, 4)
    assert np.all(np.asarray(sp.stop_reason_b) == StopReason.MAX_NEW_TOKENS)
    log = np.asarray(sp.accept_log_bi)
    passes = np.asarray(sp.n_passes_b)
    # every emitted token is accounted for: prefill's first + the per-pass counts
    assert np.array_equal(log.sum(1) + 1, np.asarray(sp.n_generated_b))
    assert np.all(log[np.arange(log.shape[1])[None] < passes[:, None]] >= 1)
    if vocab == 4:
        # the full tree holds the target's greedy choice at depths 1 and 2: >= 3 per pass
        # (the last pass of a row may be clipped by max_new_tokens)
        full = log[:, : passes.min() - 1]
        assert full.size and np.all(full >= 3)


def test_greedy_lossless_batch1_and_eos():
    spec, tp, params = make("confu", 24, seed=1)
    plan = HeadDrafter(plans.parse_plan("dynamic:3,3,8"))
    prompt = [PROMPTS[1]]
    ar = generate_ar(tp, spec.target, prompt, max_new_tokens=24, eos_ids=())
    sp = loop.generate_speculative(params.target, plan, params.drafter_params, prompt, max_new_tokens=24, eos_ids=())
    assert generated_rows(sp, 1) == generated_rows(ar, 1)
    # rows finishing at different times: stop at EOS = a token each row emits at a different step
    ar_rows = generated_rows(ar, 1)[0]
    eos = ar_rows[7]
    ar_e = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=24, eos_ids=(eos,))
    sp_e = loop.generate_speculative(params.target, plan, params.drafter_params, PROMPTS, max_new_tokens=24,
                                     eos_ids=(eos,))
    assert generated_rows(sp_e, 4) == generated_rows(ar_e, 4)
    assert np.array_equal(np.asarray(sp_e.stop_reason_b), np.asarray(ar_e.stop_reason_b))


@pytest.mark.slow
def test_cache_full_stops_cleanly():
    spec, tp, params = make("eagle3", 4)
    plan = HeadDrafter(plans.parse_plan("dynamic:2,4,20"))
    max_len = 16 + 12  # bucket 16 + a few verifications
    prompts = prompts_for(4)
    sp = loop.generate_speculative(params.target, plan, params.drafter_params, prompts, max_new_tokens=64, eos_ids=(),
                                   max_len=max_len)
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=64, eos_ids=())
    reasons = np.asarray(sp.stop_reason_b)
    assert np.all(reasons == StopReason.CACHE_FULL)
    for b, row in enumerate(generated_rows(sp, 4)):
        assert len(row) >= 1
        # lossless up to the stop, and it stopped only when no verification fits
        assert row == generated_rows(ar, 4)[b][: len(row)]
        assert len(PROMPTS[b]) + len(row) - 1 + plan.max_depth + 1 > max_len


@pytest.mark.slow
def test_one_compiled_program_no_host_round_trip():
    """The whole generation is one while_loop inside one program: no callbacks, one trace."""
    spec, tp, params = make("confu", 24)
    plan = HeadDrafter(plans.parse_plan("chain:2"))
    args, static = loop.prepare_spec_inputs(spec.target, plan, PROMPTS[:2], max_new_tokens=12, eos_ids=())
    jaxpr = jax.make_jaxpr(lambda t, d, *a: loop.speculative_padded(t, d, *a, **static))(
        params.target, params.drafter_params, *args)
    top = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert top.count("while") == 1, top

    def all_prims(jp):
        for e in jp.eqns:
            yield e.primitive.name
            for v in e.params.values():
                for j in (v if isinstance(v, (list, tuple)) else [v]):
                    inner = getattr(j, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        yield from all_prims(inner)

    prims = set(all_prims(jaxpr.jaxpr))
    assert not {p for p in prims if "callback" in p or p in ("infeed", "outfeed")}, prims
    before = loop.trace_count()
    run, args2 = loop.compile_speculative(params.target, plan, params.drafter_params, PROMPTS[:2], max_new_tokens=12,
                                          eos_ids=())
    after_compile = loop.trace_count()
    out = run(params.target, params.drafter_params, *args2)
    jax.block_until_ready(out)
    assert after_compile - before == 1 and loop.trace_count() == after_compile
    # a second prompt set in the same bucket reuses the program
    loop.generate_speculative(params.target, plan, params.drafter_params, [[1, 2], [3, 4, 5]], max_new_tokens=12,
                              eos_ids=())
    loop.generate_speculative(params.target, plan, params.drafter_params, [[7], [3, 4, 5, 6]], max_new_tokens=12,
                              eos_ids=())
    assert loop.trace_count() - after_compile <= 1


# ----------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.parametrize("plan,temperature,top_p,head_kw,unrolled", [
    ("dynamic:2,2,5", 0.7, 1.0, {}, True), ("dynamic:2,2,5", 1.0, 0.8, {}, False),
    ("sampled_chain:2", 1.0, 1.0, {}, True), ("sampled_chain:2", 0.7, 0.9, {}, False),
    ("sampled_chain:2", 1.0, 1.0, {"future_taps": True}, False),  # f read through fc: other q, the same joint
])
def test_sampling_lossless_joint(plan, temperature, top_p, head_kw, unrolled):
    """``unrolled``: the CPU decode default (unrolled layers through the few-row matmul, the draft head's
    projections packed) for a tree and a chain; the others run the scanned-layer program, ~1.5x faster at these
    25,000-row batches (tests/helpers/family_checks.py)."""
    spec, tp, params = make("confu", 8, seed=3, head_kw=head_kw, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1,
                            ffn_dim=64)
    plan = HeadDrafter(plans.parse_plan(plan))
    prompt = [1, 5, 2]
    joint = exact_joint(spec, tp, prompt, temperature, top_p)
    n_per, reps = 25_000, 4
    samples = []
    for r in range(reps):
        res = loop.generate_speculative(params.target, plan, params.drafter_params, [prompt] * n_per, max_new_tokens=3,
                                        eos_ids=(), temperature=temperature, top_p=top_p,
                                        seed=100 + r, min_bucket=4, unroll_layers=unrolled)
        toks = np.asarray(res.tokens_bn)
        assert np.all(np.asarray(res.n_generated_b) == 3)
        samples.append(toks[:, :3])
    samples = np.concatenate(samples)
    p = chi_square_pvalue(samples, joint, n_per * reps)
    assert p > 1e-3, p


def test_the_loop_takes_one_form_and_names_a_missing_or_stray_confu_field_or_a_bare_plan():
    """The loop takes ``(Target, Drafter, DrafterParams)`` and nothing else: a drafter's architecture lives in its
    params' static fields (one trace per architecture), ConFu's extras are the one optional field (None for
    EAGLE-3, required for ConFu: either mistake is named), and a bare ``DraftPlan`` is refused as a drafter."""
    from confu_jax.decode.params import DrafterParams

    for variant in ("eagle3", "confu"):
        spec, _, params = make(variant, 6)
        target, dp = params.target, params.drafter_params
        assert (dp.verify_params is None) == (variant == "eagle3") and dp.head == spec.head
        assert dp.spec(target.config) == spec and params.spec == spec
        # the architecture is static: in the tree's structure, not among its leaves
        assert jax.tree_util.tree_structure(dp) != jax.tree_util.tree_structure(dp.replace(head=None))
        drafter = HeadDrafter(plans.parse_plan("chain:2"))
        if variant == "confu":
            with pytest.raises(ValueError, match="contemplates need drafter_params.verify_params"):
                loop.generate_speculative(target, drafter, dp.replace(verify_params=None), PROMPTS[:1], max_new_tokens=2)
        else:
            with pytest.raises(ValueError, match="runs no contemplates"):
                loop.generate_speculative(target, drafter, dp.replace(verify_params={"soft_prompts": dp.weights["fc"]}),
                                          PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"expected \(Target, DrafterParams\).*got \(Target, dict\)"):
        loop.generate_speculative(target, drafter, {"draft": dp.weights}, PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(TypeError, match="expected a decode.drafter.Drafter.*got Chain"):
        loop.generate_speculative(target, plans.parse_plan("chain:2"), dp, PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(ValueError, match="need trainable\\['draft'\\]"):
        DrafterParams.for_head(spec.head, {"confu": {}}, dp.draft_vocab)
