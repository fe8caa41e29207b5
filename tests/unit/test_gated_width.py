"""Confidence-gated pass width (``HeadDrafter.min_prob``, plan ``chain:K@P``): a row verifies only
the leading drafts whose cumulative draft probability is >= P, and the loop verifies the narrowest
compiled width holding every active row's. Properties: the scores the gate reads are the drafts'
cumulative log-probabilities (against a hand-made draft); greedy output equals AR's for every P
(EAGLE-3 and ConFu heads, hybrid, batch 2, EOS); P near 1 verifies the root alone (one token per
pass); P = 0 is the ungated drafter; sampled output passes the chi-square test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import families, loop, plans
from confu_jax.decode import tree as tr
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.generate import generate_ar
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.loop_fixtures import generated_rows, jit_prefill, jit_propose, make

PROMPTS = [[3, 5, 1, 2, 4, 0], [2, 2, 5]]


def test_static_tree_scores_are_cumulative_draft_logprobs():
    """A draft whose next-token distribution depends on the parent token: the chain's scores are
    the sums of the chosen tokens' log-probabilities along the path."""
    v, k = 5, 4
    table = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(0), (v, v)) * 2.0, axis=-1)

    def expand(state, fr):
        return table[fr.tokens_bk], state

    roots = jnp.asarray([0, 3], jnp.int32)
    tree, score, _ = tr.draft_static_tree(expand, None, roots, tr.chain_structure(k), return_scores=True)
    toks = np.asarray(tree.tokens_bt)
    t = np.asarray(table)
    for b in range(2):
        want = np.cumsum([0.0] + [t[toks[b, i - 1], toks[b, i]] for i in range(1, k + 1)])
        np.testing.assert_allclose(np.asarray(score)[b], want, rtol=1e-5, atol=1e-6)
        assert all(toks[b, i] == np.argmax(t[toks[b, i - 1]]) for i in range(1, k + 1))


@pytest.mark.slow
@pytest.mark.parametrize("variant,text", [("eagle3", "chain:3@0.3"), ("confu", "chain:2@0.2"),
                                          ("eagle3", "chain:3@0.999")])
def test_gated_greedy_equals_ar(variant, text):
    spec, tp, params = make(variant, 6, seed=2)
    drafter = families.parse_drafter(variant, text)
    assert drafter.widths == tuple(range(1, drafter.n_nodes + 1))
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=24, eos_ids=())
    sp = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=24,
                                   eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log, passes = np.asarray(sp.accept_log_bi), np.asarray(sp.n_passes_b)
    assert np.array_equal(log.sum(1) + 1, np.asarray(sp.n_generated_b))
    if drafter.min_prob > 0.99:  # nothing is that confident: every pass verifies the root alone
        assert np.all(log[np.arange(log.shape[1])[None] < passes[:, None]] == 1)
    eos = generated_rows(ar, 2)[1][9]
    ar_e = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=24, eos_ids=(eos,))
    sp_e = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=24,
                                     eos_ids=(eos,))
    assert generated_rows(sp_e, 2) == generated_rows(ar_e, 2)
    assert np.array_equal(np.asarray(sp_e.stop_reason_b), np.asarray(ar_e.stop_reason_b))


@pytest.mark.slow
def test_gate_counts_the_confident_prefix_and_hybrid():
    spec, tp, params = make("eagle3", 6, seed=2)
    gated = HeadDrafter(plans.parse_plan("chain:3"), min_prob=0.3)
    ungated = HeadDrafter(plans.parse_plan("chain:3"))
    args, static = loop.prepare_spec_inputs(spec.target, gated, PROMPTS, max_new_tokens=8, eos_ids=())
    tokens_bt, lengths_b, temperature, top_p, eos_e, key = args
    kw = dict(max_new_tokens=static["max_new_tokens"], max_len=static["max_len"])
    s0 = jit_prefill(params.target, params.drafter_params, gated, tokens_bt, lengths_b, jnp.float32(0),
                     jnp.float32(1), eos_e, key, **kw)
    from confu_jax.decode.drafter import DraftInput
    from confu_jax.decode.drafting import draft_tree

    inp = DraftInput(s0.root_b, s0.cache.length_b - 1, s0.done_b, key, jnp.float32(0), jnp.float32(1))
    prop = jit_propose(gated, params.target, params.drafter_params, s0.drafter, inp)
    scores = jax.jit(lambda target, dp, state, inp: draft_tree(target, dp, gated.plan, state, inp,
                                                               with_scores=True)[-1])
    score = scores(params.target, params.drafter_params, s0.drafter, inp)
    want = 1 + np.sum(np.asarray(score)[:, 1:] >= np.log(0.3), axis=1)
    assert np.array_equal(np.asarray(prop.n_nodes_b), want)
    # the gate changes only how much is verified, not what is drafted
    full = jit_propose(ungated, params.target, params.drafter_params, s0.drafter, inp)
    assert np.array_equal(np.asarray(prop.tree.tokens_bt), np.asarray(full.tree.tokens_bt))
    assert np.all(np.asarray(full.n_nodes_b) == 4)
    # hybrid with a gated head: lossless, and its widths are the head's
    hyb = families.parse_drafter("hybrid", "chain:3@0.3")
    assert hyb.widths == (1, 2, 3, 4) and hyb.head.min_prob == 0.3
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=24, eos_ids=())
    sp = loop.generate_speculative(params.target, hyb, params.drafter_params, PROMPTS, max_new_tokens=24, eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    for text, msg in (("chain:3@1.5", "probability in"), ("dynamic:2,2,4@0.5", "needs a chain"),
                      ("chain:3@x", "probability in")):
        with pytest.raises(ValueError, match=msg):
            families.parse_drafter("eagle3", text)


@pytest.mark.slow
def test_gated_sampling_lossless_joint():
    spec, tp, params = make("eagle3", 4, seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    assert_sampling_is_lossless(spec, tp, params, families.parse_drafter("eagle3", "chain:2@0.3"))
