"""τ, tokens/s, speed-up, histograms and per-depth rates from synthetic logs, checked by hand."""

import math

import numpy as np
import pytest

from confu_jax.bench.metrics import (
    AcceptanceLogError, GenerationLog, accept_length_histogram, depth_acceptance_rates,
    per_question_speeds, speedup, summarize, tau, tokens_per_s,
)

G = GenerationLog

# Method: q1 (writing, two turns), q2 (writing), q3 (coding).
#   q1: turn 0 passes [3, 2] new 6 (=5+1 prefill) 0.5 s; turn 1 passes [1] new 2, 0.5 s
#       -> question: 8 tokens / 1.0 s = 8.0 tok/s
#   q2: passes [4, 4] new 9, 1.5 s -> 6.0 tok/s
#   q3: passes [5, 1, 2, 4] new 13, 2.0 s -> 6.5 tok/s
METHOD = [
    G(1, "writing", (3, 2), 6, 0.5, turn=0),
    G(1, "writing", (1,), 2, 0.5, turn=1),
    G(2, "writing", (4, 4), 9, 1.5),
    G(3, "coding", (5, 1, 2, 4), 13, 2.0),
]
# AR baseline on the same questions: q1 8 tokens / 2.0 s = 4.0; q2 9 / 3.0 = 3.0; q3 13 / 5.2 = 2.5
BASELINE = [
    G.autoregressive(1, "writing", 5, 1.0, turn=0),
    G.autoregressive(1, "writing", 3, 1.0, turn=1),
    G.autoregressive(2, "writing", 9, 3.0),
    G.autoregressive(3, "coding", 13, 5.2),
]


def test_tau_is_pooled_over_passes_like_specbench():
    # all passes: 3 2 1 4 4 5 1 2 4 -> 26 / 9 (a per-prompt mean would give (2+4+3)/3 = 3)
    assert tau(METHOD) == pytest.approx(26 / 9)
    assert tau(METHOD, "writing") == pytest.approx(14 / 5)
    assert tau(METHOD, "coding") == pytest.approx(12 / 4)
    assert tau(BASELINE) == 1.0
    assert math.isnan(tau(METHOD, "math"))


def test_tokens_per_s_sums_turns_then_averages_questions():
    assert per_question_speeds(METHOD) == pytest.approx({1: 8.0, 2: 6.0, 3: 6.5})
    assert tokens_per_s(METHOD) == pytest.approx((8.0 + 6.0 + 6.5) / 3)
    assert tokens_per_s(METHOD, "writing") == pytest.approx(7.0)
    assert tokens_per_s(BASELINE) == pytest.approx((4.0 + 3.0 + 2.5) / 3)


def test_speedup_overall_and_per_category():
    assert speedup(METHOD, BASELINE) == pytest.approx((20.5 / 3) / (9.5 / 3))
    assert speedup(METHOD, BASELINE, "writing") == pytest.approx(7.0 / 3.5)
    assert speedup(METHOD, BASELINE, "coding") == pytest.approx(6.5 / 2.5)
    assert speedup(BASELINE, BASELINE) == pytest.approx(1.0)


def test_speedup_refuses_different_questions():
    with pytest.raises(AcceptanceLogError, match=r"only in method: \[3\]"):
        speedup(METHOD, BASELINE[:3])


def test_histogram_and_depth_rates():
    hist = accept_length_histogram(METHOD)
    assert hist.tolist() == [0, 2, 2, 1, 3, 1]
    assert accept_length_histogram(METHOD, max_length=7).tolist() == [0, 2, 2, 1, 3, 1, 0, 0]
    with pytest.raises(AcceptanceLogError):
        accept_length_histogram(METHOD, max_length=4)
    # accepted draft tokens per pass (a - 1): [2, 1, 0, 3, 3, 4, 0, 1, 3]
    # reached depth >=0: 9, >=1: 7, >=2: 5, >=3: 4, >=4: 1, >=5: 0
    rates = depth_acceptance_rates(METHOD, depth=6)
    np.testing.assert_allclose(rates[:5], [7 / 9, 5 / 7, 4 / 5, 1 / 4, 0.0])
    assert np.isnan(rates[5])
    with pytest.raises(AcceptanceLogError, match="more than the draft depth 3"):
        depth_acceptance_rates(METHOD, depth=3)
    # AR: no draft token is ever accepted
    assert depth_acceptance_rates(BASELINE, depth=2)[0] == 0.0


def test_summarize_collects_everything():
    r = summarize("confu", METHOD, BASELINE, nodes=30, temperature=0.0, depth=5,
                  setting={"top_k": 8})
    assert (r.method, r.nodes, r.temperature, r.setting) == ("confu", 30, 0.0, {"top_k": 8})
    assert r.tau == pytest.approx(26 / 9)
    assert r.tokens_per_s == pytest.approx(20.5 / 3)
    assert r.speedup == pytest.approx(20.5 / 9.5)
    assert list(r.per_category) == ["writing", "coding"]
    assert r.per_category["writing"].tau == pytest.approx(2.8)
    assert r.per_category["writing"].speedup == pytest.approx(2.0)
    assert r.per_category["coding"].speedup == pytest.approx(2.6)
    assert r.per_category["writing"].n_questions == 2
    # the overall SR is pooled, not the mean of category SRs (2.3)
    assert r.speedup != pytest.approx((2.0 + 2.6) / 2)
    assert (r.n_questions, r.n_target_passes, r.new_tokens) == (3, 9, 30)
    assert r.wall_s == pytest.approx(4.5)
    assert r.accept_length_histogram == (0, 2, 2, 1, 3, 1)
    assert r.acceptance_rate_per_depth == pytest.approx((7 / 9, 5 / 7, 4 / 5, 1 / 4, 0.0))
    ar = summarize("ar", BASELINE, BASELINE)
    assert (ar.tau, ar.speedup, ar.acceptance_rate_per_depth) == (1.0, pytest.approx(1.0), None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(accept_lengths=(2, 0), new_tokens=3), "must be >= 1"),
        (dict(accept_lengths=(2, 2), new_tokens=7), r"must equal sum\(accept_lengths\)"),
        (dict(accept_lengths=(2, 2), new_tokens=3), r"must equal sum\(accept_lengths\)"),
        (dict(accept_lengths=(2,), new_tokens=3, wall_s=0.0), "positive finite"),
    ],
)
def test_malformed_logs_are_rejected(kwargs, message):
    args = dict(question_id=5, category="qa", wall_s=1.0) | kwargs
    with pytest.raises(AcceptanceLogError, match=message) as e:
        G(**args)
    assert "question_id=5" in str(e.value)


def test_log_json_round_trip():
    for g in METHOD + BASELINE:
        assert G.from_json(g.to_json()) == g
    assert BASELINE[2].accept_lengths == (1,) * 8
