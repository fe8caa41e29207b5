"""The decode loop's ConFu draft is the function training optimises.

Every lossless test passes whatever the draft proposes (a wrong draft only lowers τ), so nothing
else would notice a loop that feeds the draft the wrong future vector, the wrong contemplate lag or
the wrong anchor. Here the loop's depth-0 draft log-probabilities — after its prefill (lag 1) and
after a verification pass that accepted several tokens (lag = that count) — must equal the training
form at the same anchor and lag: ``real_forward`` over the decoded sequence, ``contemplate_queries``
at the anchor with [con] read from h_cat[anchor - lag], and step 0 of ``draft_ttt`` at the anchor
with that future entry (docs/DESIGN.md §4).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import drafting, loop, plans
from confu_jax.models import target as target_lib
from confu_jax.models.draft_ttt import TTTFuture, draft_ttt
from confu_jax.models.kv_cache import to_cache_layout
from test_spec_loop import make


def _loop_depth0_logprobs(spec, params, s):
    """What ``drafting.draft_tree`` scores the root's children with: ingest at the anchor p."""
    anchor_b = s.cache.length_b - 1
    future = drafting.future_entry(spec, params, s.drafter, anchor_b)
    logits, _, _ = drafting.ingest(spec, params, s.drafter, s.done_b, future, s.drafter.draft_cache)
    return np.asarray(jax.nn.log_softmax(logits[:, 0], axis=-1)), np.asarray(anchor_b)


def _training_form_logprobs(spec, params, seq, anchor, lag, *, zero_future=False, index=None):
    """Training's pieces on the decoded sequence ``seq`` (= context + the bonus token): the draft
    query at index ``index`` (default: the anchor itself) with the future entry of ``anchor``,
    whose contemplate read h_cat[anchor - lag] — a replication window when index > anchor."""
    j = anchor if index is None else index
    x = jnp.asarray([seq], jnp.int32)
    real = target_lib.real_forward(spec, params.target, x, return_logits=False)
    h_cat = real.taps_btc
    anchors = jnp.asarray([[anchor]], jnp.int32)
    f_bkd = target_lib.contemplate_queries(
        spec, params.target, params.confu, to_cache_layout(real.k_new_lbthd), to_cache_layout(real.v_new_lbthd),
        anchors, h_cat[:, [anchor - lag]])
    if zero_future:
        f_bkd = jnp.zeros_like(f_bkd)
    window = np.full((1, len(seq)), -1, np.int32)
    window[0, j] = 0
    out = draft_ttt(spec, params.draft, params.embed_vd, x, h_cat, 1,
                    future=TTTFuture(f_bkd=f_bkd, anchor_bk=anchors, index_bn=jnp.asarray(window)))
    return np.asarray(jax.nn.log_softmax(out.logits_rbnv[0, 0, j], axis=-1))


@pytest.mark.parametrize("variant,plan_text", [("confu", "dynamic:2,4,20"), ("confu_nomoe", "dynamic:2,4,20"),
                                               ("confu", "dynamic:2,4,20+c1")])
def test_loop_depth0_draft_equals_training_form(variant, plan_text):
    # vocab 4 with the full 2-level tree: the target's choice is always drafted, so the first
    # pass accepts >= 2 nodes and the second draft runs at a lag > 1. With +c1 only the root gets
    # a contemplate: the second draft's future comes from the root's position (anchor n, lag 1),
    # and the draft query at the last accepted position sits in that anchor's window.
    spec, tp, params = make(variant, 4, seed=1)
    plan = plans.parse_plan(plan_text)
    sparse = plan.contemplates == 1
    prompt = [2, 0, 3, 1, 1, 2, 0]
    args, static = loop.prepare_spec_inputs(spec, plan, [prompt], max_new_tokens=16, eos_ids=())
    tokens_bt, lengths_b, temperature, top_p, eos_e, key = args
    kw = dict(max_new_tokens=static["max_new_tokens"], max_len=static["max_len"])
    s0 = loop._prefill(spec, params, plan, tokens_bt, lengths_b, jnp.float32(0), jnp.float32(1), eos_e, key, **kw)
    s1 = loop.iteration(spec, params, plan, "greedy", s0, jnp.float32(0), jnp.float32(1), eos_e, **kw)

    n = len(prompt)
    emitted = np.asarray(s1.tokens_bn)[0, : int(s1.n_generated_b[0])].tolist()
    n_acc = int(s1.drafter.ingest_count_b[0])
    assert n_acc >= 2 and len(emitted) == 1 + n_acc  # first token + accepted drafts + bonus

    # after prefill: anchor n-1, the prefill contemplate read h_cat[n-2] (lag 1), bonus = first token
    got, anchor = _loop_depth0_logprobs(spec, params, s0)
    assert int(anchor[0]) == n - 1
    want = _training_form_logprobs(spec, params, prompt + emitted[:1], n - 1, 1)
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)

    # after one pass that accepted n_acc nodes: anchor n-1+n_acc, lag n_acc ([con] from h_cat[n-1]);
    # sparse (+c1): anchor n (the root's position), lag 1, draft index n-1+n_acc in its window
    got, anchor = _loop_depth0_logprobs(spec, params, s1)
    assert int(anchor[0]) == n - 1 + n_acc
    assert int(s1.drafter.future_anchor_b[0]) == (n if sparse else n - 1 + n_acc)
    if sparse:
        want = _training_form_logprobs(spec, params, prompt + emitted, n, 1, index=n - 1 + n_acc)
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
        return
    want = _training_form_logprobs(spec, params, prompt + emitted, n - 1 + n_acc, n_acc)
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    # the check is not vacuous: a missing future vector, or (where [con] reads h_cat: MoE_con) a
    # wrong lag, would be noticed
    wrong = _training_form_logprobs(spec, params, prompt + emitted, n - 1 + n_acc, n_acc, zero_future=True)
    assert np.abs(wrong - got[0]).max() > 1e-3
    if variant == "confu":
        wrong = _training_form_logprobs(spec, params, prompt + emitted, n - 1 + n_acc, 1)
        assert np.abs(wrong - got[0]).max() > 1e-3
