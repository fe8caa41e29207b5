"""The decode loop's ConFu draft is the function training optimises.

Every lossless test passes whatever the draft proposes (a wrong draft only lowers τ), so nothing
else would notice a loop that feeds the draft the wrong future vector, the wrong contemplate lag or
the wrong anchor. Here the loop's depth-0 draft log-probabilities — after its prefill (lag 1) and
after a verification pass that accepted several tokens (lag = that count) — must equal the training
form at the same anchor and lag: ``real_forward`` over the decoded sequence, ``contemplate_queries``
at the anchor with [con] read from h_cat[anchor - lag], and step 0 of ``draft_ttt`` at the anchor
with that future entry (docs/DESIGN.md §4).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import drafting, loop, plans
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode import verify as verify_lib
from confu_jax.models import target as target_lib
from confu_jax.models.draft_ttt import TTTFuture, draft_ttt
from confu_jax.models.kv_cache import to_cache_layout
from tests.helpers.loop_fixtures import jit_iteration, jit_prefill, jit_propose, make, with_weights

# Everything here runs under jit (eagerly, the loop's and training's primitives would each be a compile).


@jax.jit
def _depth0(target, dp, s):
    anchor_b = s.cache.length_b - 1
    future = drafting.future_entry(target, dp, s.drafter, anchor_b)
    logits, _, _ = drafting.ingest(target, dp, s.drafter, s.done_b, future, s.drafter.draft_cache)
    return jax.nn.log_softmax(logits[:, 0], axis=-1), anchor_b


def _loop_depth0_logprobs(spec, params, s):
    """What ``drafting.draft_tree`` scores the root's children with: ingest at the anchor p."""
    logp, anchor_b = _depth0(params.target, params.drafter_params, s)
    return np.asarray(logp), np.asarray(anchor_b)


@functools.partial(jax.jit, static_argnames=("spec", "steps", "zero_future"))
def _training_form(target, dp, x, anchor, lag, j, *, spec, steps, zero_future):
    real = target_lib.real_forward(spec, target.params, x, return_logits=False)
    h_cat = real.taps_btc
    if not spec.head.has_future:  # EAGLE-3: no contemplate, no future entry
        out = draft_ttt(spec, dp.weights, target.embed_vd, x, h_cat, steps)
        return jax.nn.log_softmax(out.logits_rbnv[:, 0, j], axis=-1)
    anchors = jnp.reshape(anchor, (1, 1))
    f_bkd = target_lib.contemplate_queries(
        spec, target.params, dp.verify_params, to_cache_layout(real.k_new_lbthd), to_cache_layout(real.v_new_lbthd),
        anchors, jax.lax.dynamic_slice_in_dim(h_cat, anchor - lag, 1, axis=1))
    if zero_future:
        f_bkd = jnp.zeros_like(f_bkd)
    window = jnp.where(jnp.arange(x.shape[1]) == j, 0, -1).astype(jnp.int32)[None]
    out = draft_ttt(spec, dp.weights, target.embed_vd, x, h_cat, steps,
                    future=TTTFuture(f_bkd=f_bkd, anchor_bk=anchors, index_bn=window))
    return jax.nn.log_softmax(out.logits_rbnv[:, 0, j], axis=-1)


def _training_form_logprobs(spec, params, seq, anchor, lag, *, zero_future=False, index=None, steps=1):
    """Training's pieces on the decoded sequence ``seq`` (= context + the bonus token, + the drafts
    fed to deeper steps): the draft query at index ``index`` (default: the anchor itself) with the
    future entry of ``anchor``, whose contemplate read h_cat[anchor - lag] — a replication window
    when index > anchor. ``steps`` > 1: [steps, V], TTT step r's log-probabilities at that index."""
    j = anchor if index is None else index
    logp = np.asarray(_training_form(params.target, params.drafter_params, jnp.asarray([seq], jnp.int32),
                                     jnp.int32(anchor), jnp.int32(lag),
                                     jnp.int32(j), spec=spec, steps=steps, zero_future=zero_future))
    if not spec.head.has_future:
        return logp
    return logp[0] if steps == 1 else logp


def _with_future_input(spec, params, head_kw):
    """ConFu with ``future_input``: its map starts at zero (the paper's head); give it random values."""
    if not head_kw.get("future_input"):
        return params
    d = spec.target.d_model
    kernel = 0.3 * jax.random.normal(jax.random.PRNGKey(11), (d, d), jnp.float32)
    return with_weights(params, future_in={"kernel": kernel})


@pytest.mark.slow
@pytest.mark.parametrize("variant,plan_text,head_kw", [
    ("confu", "dynamic:2,4,20", {}), ("confu_nomoe", "dynamic:2,4,20", {}), ("confu", "dynamic:2,4,20+c1", {}),
    ("confu", "dynamic:2,4,20+c1", {"future_input": True}), ("confu", "dynamic:2,4,20", {"future_taps": True})],
    ids=["confu", "confu_nomoe", "confu_sparse", "confu_sparse_future_input", "confu_future_taps"])
def test_loop_depth0_draft_equals_training_form(variant, plan_text, head_kw):
    # vocab 4 with the full 2-level tree: the target's choice is always drafted, so the first
    # pass accepts >= 2 nodes and the second draft runs at a lag > 1. With +c1 only the root gets
    # a contemplate: the second draft's future comes from the root's position (anchor n, lag 1),
    # and the draft query at the last accepted position sits in that anchor's window.
    spec, tp, params = make(variant, 4, seed=1, head_kw=head_kw)
    params = _with_future_input(spec, params, head_kw)
    plan = HeadDrafter(plans.parse_plan(plan_text))
    sparse = plan.plan.contemplates == 1
    prompt = [2, 0, 3, 1, 1, 2, 0]
    args, static = loop.prepare_spec_inputs(spec.target, plan, [prompt], max_new_tokens=16, eos_ids=())
    tokens_bt, lengths_b, temperature, top_p, eos_e, key = args
    kw = dict(max_new_tokens=static["max_new_tokens"], max_len=static["max_len"])
    s0 = jit_prefill(params.target, params.drafter_params, plan, tokens_bt, lengths_b, jnp.float32(0), jnp.float32(1),
                     eos_e, key, **kw)
    s1 = jit_iteration(params.target, params.drafter_params, plan, verify_lib.GREEDY, s0, jnp.float32(0),
                       jnp.float32(1), eos_e, **kw)

    n = len(prompt)
    emitted = np.asarray(s1.tokens_bn)[0, : int(s1.n_generated_b[0])].tolist()
    n_acc = int(s1.drafter.ingest_count_b[0])
    assert n_acc >= 2 and len(emitted) == 1 + n_acc  # first token + accepted drafts + bonus

    # after prefill: anchor n-1, the prefill contemplate read h_cat[n-2] (lag 1), bonus = first token
    got, anchor = _loop_depth0_logprobs(spec, params, s0)
    assert int(anchor[0]) == n - 1
    want = _training_form_logprobs(spec, params, prompt + emitted[:1], n - 1, 1)
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    if head_kw.get("future_input"):  # not vacuous: f's map into the first step moves the draft
        kernel = params.drafter_params.weights["future_in"]["kernel"]
        zeroed = with_weights(params, future_in={"kernel": jnp.zeros_like(kernel)})
        assert np.abs(_loop_depth0_logprobs(spec, zeroed, s0)[0][0] - got[0]).max() > 1e-3

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


@pytest.mark.slow
@pytest.mark.parametrize("variant,head_kw", [("eagle3", {}), ("confu", {"future_bias": 1.0}), ("confu_nomoe", {}),
                                             ("confu", {"future_input": True}), ("confu", {"future_taps": True})],
                         ids=["eagle3", "confu_future_bias", "confu_nomoe", "confu_future_input", "confu_future_taps"])
def test_loop_deep_drafts_equal_training_steps(variant, head_kw):
    """Depths 1..3: the loop's chain drafts, each fed the loop's own previous draft, equal TTT steps
    1..3 of ``draft_ttt`` at the anchor on (context, bonus, those drafts) — after the prefill and after
    a pass that accepted several tokens (ConFu: lag > 1). A sampled chain at T = 1 exposes every depth's q:
    q at node d+1 = softmax of the draft at depth d. Together with the depth-0 test above, the
    loop's whole chain is the function training optimises (issue: deep steps accepted too rarely).
    ConFu here carries the learned future-entry logit (``future_bias``; the depth-0 test above and
    confu_nomoe run without it): both forms add the same logit."""
    from confu_jax.decode.drafter import DraftInput
    from confu_jax.decode.drafting import HeadDrafter

    spec, tp, params = make(variant, 4, seed=1, head_kw=head_kw)
    if head_kw.get("future_bias") is not None:  # the random init gives the bias values near 0: make it matter
        params = with_weights(params, future_bias=jnp.linspace(-2.0, 3.0, spec.target.n_heads))
    params = _with_future_input(spec, params, head_kw)
    full = HeadDrafter(plans.parse_plan("dynamic:3,4,36"))  # all of depth 1 and most of depths 2-3 of vocab 4
    chain = HeadDrafter(plans.parse_plan("sampled_chain:3"))
    prompt = [2, 0, 3, 1, 1, 2, 0]
    args, static = loop.prepare_spec_inputs(spec.target, full, [prompt], max_new_tokens=16, eos_ids=())
    tokens_bt, lengths_b, temperature, top_p, eos_e, key = args
    kw = dict(max_new_tokens=static["max_new_tokens"], max_len=static["max_len"])
    s0 = jit_prefill(params.target, params.drafter_params, full, tokens_bt, lengths_b, jnp.float32(0), jnp.float32(1),
                     eos_e, key, **kw)
    s1 = jit_iteration(params.target, params.drafter_params, full, verify_lib.GREEDY, s0, jnp.float32(0),
                       jnp.float32(1), eos_e, **kw)
    emitted = np.asarray(s1.tokens_bn)[0, : int(s1.n_generated_b[0])].tolist()
    n_acc = int(s1.drafter.ingest_count_b[0])  # nodes accepted, root included: the next draft's lag
    assert n_acc >= 2 and len(emitted) == 1 + n_acc, emitted  # first token + accepted drafts + bonus

    for s, context, lag in ((s0, prompt + emitted[:1], 1), (s1, prompt + emitted, n_acc)):
        anchor = int(s.cache.length_b[0]) - 1
        assert anchor == len(context) - 2  # the context ends with the bonus token x[p+1]
        inp = DraftInput(s.root_b, s.cache.length_b - 1, s.done_b, jax.random.PRNGKey(7), jnp.float32(1),
                         jnp.float32(1))
        prop = jit_propose(chain, params.target, params.drafter_params, s.drafter, inp)
        tokens = np.asarray(prop.tree.tokens_bt)[0].tolist()
        assert tokens[0] == context[-1]
        got = np.log(np.maximum(np.asarray(prop.q_btv)[0, 1:], 1e-30))  # [3,V] depths 0..2 of the chain
        want = _training_form_logprobs(spec, params, context + tokens[1:], anchor, lag, steps=4)  # [4,V]
        np.testing.assert_allclose(got, want[:3], rtol=1e-4, atol=1e-4)
        # not vacuous: step r differs from step r-1 and from a step fed another token
        assert np.abs(want[1] - want[0]).max() > 1e-3 and np.abs(want[2] - want[1]).max() > 1e-3
        other = list(tokens[1:])
        other[0] = (other[0] + 1) % 4
        moved = _training_form_logprobs(spec, params, context + other, anchor, lag, steps=4)
        assert np.abs(moved[1] - got[1]).max() > 1e-3
