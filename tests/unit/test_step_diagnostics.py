"""Per-TTT-step diagnostics of held-out evaluation: ``cond_acc/step{r}`` (step r right given steps
< r right at the same index, speculators' ``prev_correct``) and ``dup_rate/step{r}`` (step r's top-1
repeats step r−1's), against plain-Python references, a hand-made case, and the loss function."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.models.draft_ttt import draft_ttt
from confu_jax.models.target import real_forward
from confu_jax.train import loss as L
from confu_jax.train.acceptance import (conditional_step_accuracy, simulated_acceptance_length,
                                        step_duplication_rate)
from tests.helpers.model_fakes import tiny_objective_case


# ----------------------------------------------------------------------------- references


def _cond_reference(correct, answer, in_draft, base):
    """One index at a time: a starting point j (base[j], x[j+2] an answer token) counts toward step
    r's denominator while steps 0..r-1 were all right, and toward its numerator if step r is too."""
    r_steps, b, n = correct.shape
    num, den = np.zeros(r_steps), np.zeros(r_steps)
    for row in range(b):
        for j in range(n):
            if not (base[row, j] and answer[0, row, j]):
                continue
            for r in range(r_steps):
                den[r] += 1
                if not (correct[r, row, j] and in_draft[r, row, j] and answer[r, row, j]):
                    break
                num[r] += 1
    return [num[r] / den[r] if den[r] else 0.0 for r in range(r_steps)]


def _dup_reference(top1, valid):
    r_steps, b, n = top1.shape
    out = []
    for r in range(1, r_steps):
        pairs = [(top1[r, row, j] == top1[r - 1, row, j]) for row in range(b) for j in range(n) if valid[r, row, j]]
        out.append(float(np.mean(pairs)) if pairs else 0.0)
    return out


# ----------------------------------------------------------------------------- the functions


def test_conditional_accuracy_hand_made_case():
    # one row, four starting points, three steps ("right" = hit & in draft & answer):
    #   j=0: right, right, right    j=1: right, right, wrong    j=2: right, wrong, right
    #   j=3: wrong, right, right    j=4: not a starting point (base False), all right
    right = np.array([[1, 1, 1, 0, 1],
                      [1, 1, 0, 1, 1],
                      [1, 0, 1, 1, 1]], bool)[:, None, :]
    base = np.array([[1, 1, 1, 1, 0]], bool)
    ones = np.ones_like(right)
    got = np.asarray(conditional_step_accuracy(*(jnp.asarray(x) for x in (right, ones, ones, base))))
    # step 0: 3 of 4; step 1: of j=0,1,2 (step 0 right) j=0,1 -> 2/3; step 2: of j=0,1 only j=0 -> 1/2
    np.testing.assert_allclose(got, [3 / 4, 2 / 3, 1 / 2], rtol=1e-6)
    # the unconditional accuracy of step 2 over the same starting points is 3/4: the conditional
    # one is what a chain accepts
    # an answer that ends before step 2 (x[j+4] not an answer token) stops j=0's run there
    answer = ones.copy()
    answer[2, 0, 0] = False
    got = np.asarray(conditional_step_accuracy(*(jnp.asarray(x) for x in (right, answer, ones, base))))
    np.testing.assert_allclose(got, [3 / 4, 2 / 3, 0.0], rtol=1e-6)


def test_duplication_rate_hand_made_case():
    top1 = np.array([[5, 6, 7, 8],
                     [5, 1, 7, 2],    # j=0 and j=2 repeat step 0
                     [5, 1, 3, 2]])[:, None, :]  # j=0, 1, 3 repeat step 1
    valid = np.ones(top1.shape, bool)
    valid[2, 0, 3] = False  # not trained at step 2: not counted
    got = np.asarray(step_duplication_rate(jnp.asarray(top1), jnp.asarray(valid)))
    np.testing.assert_allclose(got, [2 / 4, 2 / 3], rtol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_conditional_accuracy_and_duplication_match_python_loops(seed):
    rng = np.random.default_rng(seed)
    r_steps, b, n = 5, 3, 23
    correct = rng.random((r_steps, b, n)) < rng.uniform(0.3, 0.9)
    answer = rng.random((r_steps, b, n)) < 0.9
    in_draft = rng.random((r_steps, b, n)) < 0.9
    base = rng.random((b, n)) < 0.7
    top1 = rng.integers(0, 3, (r_steps, b, n))  # few ids: duplicates are common
    valid = rng.random((r_steps, b, n)) < 0.8
    args = [jnp.asarray(x) for x in (correct, answer, in_draft, base)]
    cond = np.asarray(conditional_step_accuracy(*args))
    np.testing.assert_allclose(cond, _cond_reference(correct, answer, in_draft, base), rtol=1e-6, atol=1e-7)
    dup = np.asarray(jax.jit(step_duplication_rate)(jnp.asarray(top1), jnp.asarray(valid)))
    np.testing.assert_allclose(dup, _dup_reference(top1, valid), rtol=1e-6)
    # the chain's τ is the sum of the products of the conditional accuracies
    tau = float(simulated_acceptance_length(*args))
    assert tau == pytest.approx(1 + np.sum(np.cumprod(cond)), rel=1e-5)


def test_steps_no_index_reaches_read_zero():
    correct = np.zeros((3, 1, 6), bool)
    ones = np.ones_like(correct)
    cond = np.asarray(conditional_step_accuracy(jnp.asarray(correct), jnp.asarray(ones), jnp.asarray(ones)))
    np.testing.assert_array_equal(cond, [0.0, 0.0, 0.0])
    assert step_duplication_rate(jnp.zeros((1, 1, 4), jnp.int32), jnp.ones((1, 1, 4), bool)).shape == (0,)


# ----------------------------------------------------------------------------- in the loss

V, NB, NN, STEPS = 6, 2, 24, 3  # a tiny vocabulary: a random draft's top-1 is often right


@functools.lru_cache(maxsize=None)
def _tiny(variant, seed=3):
    """tests.helpers.model_fakes.tiny_objective_case and its metrics under the evaluation-form objective."""
    spec, tp, tr, dv, batch = tiny_objective_case(variant, seed, V, NB, NN)
    cfg = L.ObjectiveConfig(ttt_steps=STEPS, k_train=L.ALL_POSITIONS, replication=0, max_lag=2, vocab_chunk=4)
    _, metrics = jax.jit(lambda tr, batch: L.confu_loss(spec, tr, tp, dv, batch, jax.random.PRNGKey(0), cfg))(
        tr, batch)
    return spec, tp, tr, dv, batch, jax.device_get(metrics)


def _eagle3_reference():
    """cond_acc and dup_rate of the EAGLE-3 objective from the full logits, one index at a time:
    the teacher's argmax over the draft vocabulary, the t2d mask, the draft's TTT logits."""
    spec, tp, tr, dv, batch, _ = _tiny("eagle3")
    lm = np.asarray(batch["loss_mask"]) & np.asarray(batch["attention_mask"])
    out = real_forward(spec, tp, batch["tokens"])
    full = np.asarray(out.logits_btv, np.float64)
    d2t, t2d = np.asarray(dv["d2t"]), np.asarray(dv["t2d"])
    teacher_top1, in_draft = full[..., d2t].argmax(-1), t2d[full.argmax(-1)]
    ttt = draft_ttt(spec, tr["draft"], tp["embed"]["embedding"], batch["tokens"], out.taps_btc, STEPS)
    draft_top1 = np.asarray(ttt.logits_rbnv, np.float64).argmax(-1)

    def trained(r, row, j):
        return j + 2 + r < NN and lm[row, j + 2 + r] and in_draft[row, j + 1 + r]

    def right(r, row, j):
        return trained(r, row, j) and draft_top1[r, row, j] == teacher_top1[row, j + 1 + r]

    num, den = np.zeros(STEPS), np.zeros(STEPS)
    for row in range(NB):
        for j in range(NN - 2):
            if lm[row, j + 1] and lm[row, j + 2]:  # a verification starting point
                for r in range(STEPS):
                    den[r] += 1
                    if not right(r, row, j):
                        break
                    num[r] += 1
    dup, text_dup = [], []
    for r in range(1, STEPS):
        idx = [(row, j) for row in range(NB) for j in range(NN) if trained(r, row, j)]
        dup.append(np.mean([draft_top1[r, row, j] == draft_top1[r - 1, row, j] for row, j in idx]))
        text_dup.append(np.mean([teacher_top1[row, j + 1 + r] == teacher_top1[row, j + r] for row, j in idx]))
    return num / np.maximum(den, 1), dup, text_dup


@pytest.mark.slow
def test_eagle3_loss_reports_the_reference_diagnostics():
    m = _tiny("eagle3")[-1]
    cond, dup, text_dup = _eagle3_reference()
    assert all(0 < c < 1 for c in cond) and all(0 < d < 1 for d in dup)  # not a vacuous case
    for r in range(STEPS):
        assert float(m[f"cond_acc/step{r}"]) == pytest.approx(cond[r], abs=1e-6)
    for r in range(1, STEPS):
        assert float(m[f"dup_rate/step{r}"]) == pytest.approx(dup[r - 1], abs=1e-6)
        assert float(m[f"dup_rate_teacher/step{r}"]) == pytest.approx(text_dup[r - 1], abs=1e-6)
    assert "dup_rate/step0" not in m


@pytest.mark.parametrize("variant", ["eagle3", "confu"])
def test_loss_metrics_are_rates_that_rebuild_tau_sim(variant):
    m = _tiny(variant)[-1]
    cond = [float(m[f"cond_acc/step{r}"]) for r in range(STEPS)]
    assert all(0.0 <= c <= 1.0 for c in cond) and cond[0] > 0
    for r in range(1, STEPS):
        for key in (f"dup_rate/step{r}", f"dup_rate_teacher/step{r}"):
            assert 0.0 <= float(m[key]) <= 1.0, key
    assert float(m["acceptance_length"]) == pytest.approx(1 + np.sum(np.cumprod(cond)), rel=1e-5)


@pytest.mark.slow
def test_confu_training_form_reports_them_too():
    # training form: K anchors, windows, the head evaluated at the window indices only ([B, M])
    spec, tp, tr, dv, batch, _ = _tiny("confu")
    cfg = L.ObjectiveConfig(ttt_steps=STEPS, k_train=2, replication=1, max_lag=2, vocab_chunk=4)
    _, m = L.confu_loss(spec, tr, tp, dv, batch, jax.random.PRNGKey(1), cfg)
    cond = [float(m[f"cond_acc/step{r}"]) for r in range(STEPS)]
    assert all(0.0 <= c <= 1.0 for c in cond)
    assert float(m["acceptance_length"]) == pytest.approx(1 + np.sum(np.cumprod(cond)), rel=1e-5)
    assert all(0.0 <= float(m[f"dup_rate/step{r}"]) <= 1.0 for r in range(1, STEPS))
