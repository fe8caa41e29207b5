"""Budget ``auto``: the estimator's arithmetic and the argmax, on hand-computed cases, plus one
measured run on the tiny model (the chosen plan is the argmax of what was measured, and the chain
estimate at the calibrated length is the calibration's own τ)."""

import numpy as np
import pytest

from confu_jax.bench import budget
from confu_jax.bench.budget import Candidate


def test_tau_estimators_by_hand():
    # rates 0.8, 0.5, 0.5: 1 + 0.8 = 1.8; + 0.4 = 2.2; + 0.2 = 2.4
    assert budget.tau_from_rates([0.8, 0.5, 0.5], 1) == pytest.approx(1.8)
    assert budget.tau_from_rates([0.8, 0.5, 0.5], 3) == pytest.approx(2.4)
    with pytest.raises(ValueError, match="3 depths"):
        budget.tau_from_rates([0.8, 0.5], 3)
    # accepted counts of a chain:3 run: P(n>=1)=4/5, P(n>=2)=3/5, P(n>=3)=2/5
    n = [0, 1, 2, 3, 3]
    assert budget.tau_chain_from_accepts(n, 1, 3) == pytest.approx(1.8)
    assert budget.tau_chain_from_accepts(n, 2, 3) == pytest.approx(2.4)
    assert budget.tau_chain_from_accepts(n, 3, 3) == pytest.approx(1 + np.mean(n))
    with pytest.raises(ValueError, match="chain:4 cannot"):
        budget.tau_chain_from_accepts(n, 4, 3)


def test_choice_depends_on_the_device_timings():
    taus = {"chain:1": 1.8, "chain:2": 2.2, "chain:3": 2.4, "dynamic:6,8,30": 3.0}
    # CPU-like: verification cost grows with T. tokens/s: 18, 20, 18.46, 15 -> chain:2
    cpu = {"chain:1": 0.10, "chain:2": 0.11, "chain:3": 0.13, "dynamic:6,8,30": 0.20}
    best = budget.choose([Candidate(p, taus[p], cpu[p]) for p in taus])
    assert best.plan == "chain:2" and best.tokens_per_s == pytest.approx(20.0)
    # accelerator-like: a pass costs the same for any T -> the largest E[tau] wins
    flat = budget.choose([Candidate(p, taus[p], 0.1) for p in taus])
    assert flat.plan == "dynamic:6,8,30"
    # equal estimates: the smaller tree (chain:2 has T=3 nodes, dynamic:3,2,4 has T=5)
    tie = budget.choose([Candidate("dynamic:3,2,4", 2.0, 0.1), Candidate("chain:2", 2.0, 0.1)])
    assert tie.plan == "chain:2"
    with pytest.raises(ValueError, match="no candidate"):
        budget.choose([])


@pytest.mark.slow
def test_auto_plan_on_tiny_model():
    from confu_jax.decode.loaded import head_weights
    from confu_jax.models.vocab_map import identity_draft_vocab
    from confu_jax.models.presets import get_preset
    from confu_jax.models.spec import HeadConfig, ModelSpec
    from tests.helpers.model_fakes import tiny_params

    vocab = 4  # a tiny vocabulary: random drafts are often right, so tau varies with the plan
    spec = ModelSpec(get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=()),
                     HeadConfig(variant="eagle3", draft_vocab_size=vocab, init_std=0.2))
    tp, tr = tiny_params(spec, 0)
    h = head_weights(spec.target, tp, spec.head, tr, identity_draft_vocab(vocab, vocab), False, "test")
    target, dp = h.target, h.drafter_params
    prompts = [[1, 2, 3, 0, 1], [3, 3, 2]]
    seen = []
    best, cands = budget.auto_plan(target, dp, prompts, chains=("chain:1", "chain:3"), trees=(),
                                   max_new_tokens=24, log=seen.append)
    assert [c.plan for c in cands] == ["ar", "chain:1", "chain:3"] and len(seen) == 3
    assert cands[0].expected_tau == 1.0 and cands[0].pass_s > 0  # plain AR competes (tau 1 by definition)
    assert best.tokens_per_s == max(c.tokens_per_s for c in cands)
    assert all(c.pass_s > 0 and 1.0 <= c.expected_tau <= budget.plan_nodes(c.plan) for c in cands)
    # E[tau] is the measured tau: every accepted count within [0, k], bonus adds 1
    tau3, accepted, pass_s = budget.measure_plan(target, dp, "chain:3", prompts, max_new_tokens=24)
    assert cands[1].expected_tau == pytest.approx(tau3) == pytest.approx(1 + accepted.mean())
    assert accepted.min() >= 0 and accepted.max() <= 3 and pass_s > 0
    # the chain:1 estimate from chain:3's accepted counts is within [1, 2]
    assert 1.0 <= budget.tau_chain_from_accepts(accepted, 1, 3) <= 2.0


@pytest.mark.slow
def test_interleaved_calibration_measures_the_same_plans(monkeypatch):
    """interleave: the candidates decode the prompts in turn (prompt by prompt, the first rotating),
    with the same τ as one candidate after another; only the order of the timed calls changes."""
    from confu_jax.decode.loaded import head_weights
    from confu_jax.models.vocab_map import identity_draft_vocab
    from confu_jax.models.presets import get_preset
    from confu_jax.models.spec import HeadConfig, ModelSpec
    from tests.helpers.model_fakes import tiny_params

    vocab = 4
    spec = ModelSpec(get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=()),
                     HeadConfig(variant="eagle3", draft_vocab_size=vocab, init_std=0.2))
    tp, tr = tiny_params(spec, 0)
    h = head_weights(spec.target, tp, spec.head, tr, identity_draft_vocab(vocab, vocab), False, "test")
    target, dp = h.target, h.drafter_params
    prompts = [[1, 2, 3, 0, 1], [3, 3, 2], [2, 1]]
    order = []
    real_plan, real_ar = budget._plan_runner, budget._ar_runner

    def spy(name, decode):
        def run(prompt, timed=True):
            if timed:
                order.append((name, tuple(prompt)))
            return decode(prompt, timed)
        return run

    monkeypatch.setattr(budget, "_plan_runner", lambda t, d, plan, **kw: spy(plan, real_plan(t, d, plan, **kw)))
    monkeypatch.setattr(budget, "_ar_runner", lambda t, **kw: spy("ar", real_ar(t, **kw)))
    kw = dict(chains=("chain:1", "chain:2"), trees=(), max_new_tokens=12, min_bucket=16)
    _, seq = budget.auto_plan(target, dp, prompts, **kw)
    order.clear()
    _, inter = budget.auto_plan(target, dp, prompts, interleave=True, **kw)
    assert [c.plan for c in inter] == [c.plan for c in seq] == ["ar", "chain:1", "chain:2"]
    assert [c.expected_tau for c in inter] == [c.expected_tau for c in seq]
    timed = order[-9:]
    assert [n for n, _ in timed] == ["ar", "chain:1", "chain:2", "chain:1", "chain:2", "ar", "chain:2", "ar",
                                     "chain:1"]
    assert [p for _, p in timed] == [tuple(p) for p in prompts for _ in range(3)]


def test_ar_wins_when_speculation_does_not_pay():
    """Budget auto can say no: a plan whose tau does not cover its pass cost loses to plain AR."""
    ar = Candidate(budget.AR, 1.0, 0.050)
    slow = Candidate("chain:3", 1.4, 0.118)  # the CPU figures: 2.3x an AR step for tau 1.4
    fast = Candidate("chain:3", 2.4, 0.080)
    assert budget.choose([slow, ar]).plan == budget.AR
    assert budget.choose([ar, fast]).plan == "chain:3"
    assert budget.plan_nodes(budget.AR) == 1


def test_calibration_compiles_every_prompt_bucket_before_timing(monkeypatch):
    """Prompts of several lengths fall in several padded widths, each its own compiled program: every
    width is warmed up before the first timed call, so no compilation is timed as decoding (warming
    only the first prompt doubled SmolLM2's measured pass cost)."""
    from types import SimpleNamespace

    from confu_jax.decode import generate, loop
    from confu_jax.decode.requests import bucket_length, one_prompt_per_bucket

    prompts = [[1] * 10, [1] * 70, [1] * 100, [1] * 200, [1] * 65]  # widths 64, 128, 128, 256, 128
    assert [len(p) for p in one_prompt_per_bucket(prompts, 64)] == [10, 70, 200]
    for module, name in ((loop, "generate_speculative"), (generate, "generate_ar")):
        clock, calls = [0], []

        def tick():  # odd between a timed call's t0 and t1, even otherwise
            clock[0] += 1
            return float(clock[0])

        def fake_decode(*args, **kw):
            calls.append(("timed" if clock[0] % 2 else "warm", bucket_length(len(args[-1][0]), kw["min_bucket"])))
            return SimpleNamespace(n_passes_b=np.array([2]), accept_log_bi=np.array([[2, 1]]),
                                   n_generated_b=np.array([4]))

        monkeypatch.setattr(module, name, fake_decode)
        monkeypatch.setattr(budget.time, "perf_counter", tick)
        fakes = SimpleNamespace(params=None, config=None)
        if name == "generate_speculative":
            budget.measure_plan(fakes, fakes, "chain:1", prompts, min_bucket=64)
        else:
            budget.measure_ar(fakes, prompts, min_bucket=64)
        monkeypatch.undo()
        kinds = [kind for kind, _ in calls]
        assert kinds == ["warm"] * 3 + ["timed"] * len(prompts), (name, calls)
        assert sorted(b for kind, b in calls if kind == "warm") == [64, 128, 256]


def test_pick_calibration_takes_the_measured_prompts_commonest_width():
    """Calibration prompts share the padded width most measured prompts have (so their compiled
    programs serve the measured rows too), evenly spread over the pool in pool order; ties go to the
    narrower width; too few at that width are made up from the others, evenly."""
    ids = lambda n: list(range(n))  # a prompt of n tokens
    # widths with min_bucket 64: 64, 128, 256
    pool = [ids(n) for n in (100, 30, 200, 40, 120, 50, 60, 70)]  # widths 128 64 256 64 128 64 64 128
    measured = [ids(n) for n in (10, 20, 64, 65, 210)]  # 64 x3, 128, 256
    assert budget.pick_calibration(pool, measured, 2) == [1, 5]  # of [1, 3, 5, 6]: every second
    assert budget.pick_calibration(pool, measured, 4) == [1, 3, 5, 6]
    # 5 wanted, 4 at width 64: the fifth from the other widths' [0, 2, 4, 7], evenly (the first)
    assert budget.pick_calibration(pool, measured, 5) == [0, 1, 3, 5, 6]
    # a tie between 64 and 128 (one each) goes to the narrower
    assert budget.pick_calibration(pool, [ids(10), ids(100)], 1) == [1]
    # width 128 commonest
    assert budget.pick_calibration(pool, [ids(100), ids(90), ids(10)], 3) == [0, 4, 7]
    # no measured prompts: evenly over the whole pool (the earlier behaviour); nothing asked: nothing
    assert budget.pick_calibration(pool, [], 2) == [0, 4]
    assert budget.pick_calibration(pool, measured, 0) == [] and budget.pick_calibration([], measured, 2) == []
    # min_bucket moves the widths: with 256 every prompt shares one
    assert budget.pick_calibration(pool, measured, 2, min_bucket=256) == [0, 4]
