"""Scaling curves (``bench.scaling``, ``launch.scaling_curve``): the log-linear fit recovers an exact
line, its confidence band and the goal interval (Fieller's) cover the truth at their nominal rate
on simulated data, and the launcher measures a run's milestones end to end (decoded τ lossless,
tokens seen from the run's metrics, the training evaluation's τ read at the same steps)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from confu_jax.bench import scaling
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "specbench_sample.jsonl")
TOKENS = np.array([2e4, 4e4, 8e4, 1.6e5, 3.2e5, 6.4e5])


def test_an_exact_line_is_recovered_with_its_goal_tokens():
    tau = 1.1 + 0.15 * np.log10(TOKENS)
    fit = scaling.fit_log_linear(TOKENS, tau)
    assert fit.a == pytest.approx(1.1, abs=1e-9) and fit.b == pytest.approx(0.15, abs=1e-9)
    assert fit.n == 6 and fit.dof == 4 and fit.tokens_range == (2e4, 6.4e5)
    goal = scaling.tokens_for(fit, 2.0)  # 10^((2.0 - 1.1) / 0.15) = 10^6
    assert goal["tokens"] == pytest.approx(1e6, rel=1e-6)
    # no residuals: the band is the line, so the interval closes on the estimate (grid step 10^0.01)
    assert goal["lo"] == pytest.approx(1e6, rel=0.024) and goal["hi"] == pytest.approx(1e6, rel=0.024)
    flat = scaling.fit_log_linear(TOKENS, np.full(6, 1.3) + np.array([0, 1e-3, -1e-3, 0, 1e-3, -1e-3]))
    assert math.isinf(scaling.tokens_for(flat, 2.0)["hi"])  # a line that does not rise never gets there
    with pytest.raises(ValueError, match="distinct token counts"):
        scaling.fit_log_linear([1e4, 1e4], [1.2, 1.3])
    with pytest.raises(ValueError, match="> 0"):
        scaling.fit_log_linear([0, 1e4], [1.2, 1.3])


def test_band_and_goal_interval_cover_the_truth_at_their_nominal_rate():
    """Gaussian noise around a true line: the 95% band at an extrapolated point and the goal
    interval each contain the truth in 95% of 1000 simulated curves (binomial: |rate - 0.95| < 0.025
    is more than 3.5 standard deviations)."""
    rng = np.random.default_rng(0)
    a, b, sigma, goal = 1.1, 0.12, 0.03, 1.9
    x_far = 1e7
    true_tokens = 10 ** ((goal - a) / b)
    band_hits = goal_hits = 0
    n = 1000
    for _ in range(n):
        tau = a + b * np.log10(TOKENS) + rng.normal(0, sigma, TOKENS.shape)
        fit = scaling.fit_log_linear(TOKENS, tau)
        lo, hi = fit.band([x_far])
        band_hits += lo[0] <= a + b * 7 <= hi[0]
        g = scaling.tokens_for(fit, goal)
        goal_hits += g["lo"] <= true_tokens <= g["hi"]
    assert abs(band_hits / n - 0.95) < 0.025, band_hits
    assert abs(goal_hits / n - 0.95) < 0.025, goal_hits


def test_table_and_figure(tmp_path):
    pts = [scaling.Point(method=m, series="chain:3", step=s, tokens=t, tau=1.0 + k * np.log10(t) / 10,
                         tau_lo=0.9, tau_hi=1.9, lossless=True)
           for m, k in (("eagle3", 1.0), ("confu", 1.1)) for s, t in zip(range(1, 7), TOKENS)]
    md, fits = scaling.table(pts, goals=(2.0,), tokens_per_s={"eagle3": 100.0})
    assert set(fits) == {"eagle3|chain:3", "confu|chain:3"}
    assert fits["eagle3|chain:3"]["goals"]["2.0"]["tokens"] == pytest.approx(1e10, rel=1e-6)
    assert "tokens for τ 2 [95%]" in md and "1e+10" not in md and "10B" in md and "h |" in md
    # points below min_tokens are listed, not fitted: the fit of the rest is the same line (exact data)
    md2, fits2 = scaling.table(pts, goals=(2.0,), min_tokens=5e4)
    assert fits2["eagle3|chain:3"]["n"] == 4 and md2.count("| eagle3 | chain:3 |") == 6 + 1  # 6 points, 1 fit
    assert fits2["eagle3|chain:3"]["b"] == pytest.approx(0.1, abs=1e-9)
    scaling.figure(pts, str(tmp_path / "curve.png"), min_tokens=5e4)
    assert (tmp_path / "curve.png").stat().st_size > 5000


@pytest.fixture(scope="module")
def milestone_run(tmp_path_factory):
    """A tiny EAGLE-3 run against the tiny chat GGUF, evaluated and kept at milestones 1 and 3."""
    from configs.tiny import get_config
    from confu_jax.train.loop import train
    from tests.helpers.tiny_chat_model import tiny_chat_gguf

    tmp = tmp_path_factory.mktemp("scaling")
    gguf = tiny_chat_gguf(tmp, layers=8, max_pos=2048)
    topics = ["rivers", "bread", "chess", "comets", "violins", "glaciers", "bees", "bridges"]
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me about {topics[i % 8]}, please."},
        {"from": "gpt", "value": f"Here is what I know about {topics[i % 8]}: they are old, they are "
                                 f"studied, and people like {topics[(i + 1) % 8]} as well. " * 2}]} for i in range(24)]
    data = tmp / "convs.json"
    data.write_text(json.dumps(convs))
    config = get_config("eagle3")
    config.model.preset, config.model.source = "tiny-chat", gguf
    config.data.train_files, config.data.max_length, config.data.global_batch_size = str(data), 64, 8
    config.data.min_loss_tokens, config.objective.eval_records, config.objective.eval_batches = 1, 8, 1
    config.train.steps, config.train.milestones, config.train.eval_every = 4, "1,3", 0
    config.train.checkpoint.every, config.train.checkpoint.keep = 0, 1
    config.train.log_every, config.train.progress_bar, config.train.tensorboard = 1, False, "off"
    workdir = str(tmp / "eagle3")
    train(config, workdir)
    return gguf, workdir, tmp


@pytest.mark.slow
def test_measure_and_fit_a_runs_milestones(milestone_run):
    from confu_jax.runs.lineage import row_tokens
    from confu_jax.train.metric_writers import read_csv

    gguf, workdir, tmp = milestone_run
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    points = tmp / "points.json"
    r = subprocess.run([sys.executable, "-m", "launch.scaling_curve", "measure", "--model", gguf,
                        "--runs", f"eagle3={workdir}", "--prompts", FIXTURE, "--budgets", "chain:2,dynamic:2,2,4",
                        "--max_new_tokens", "8", "--eval_depths", "1,3", "--out", str(points)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(points.read_text())
    got = {(p["series"], p["step"]): p for p in doc["points"]}
    # the milestones and the end of the run (step 4) were kept; every one is measured every way
    assert set(got) == {(s, k) for s in ("chain:2", "dynamic:2,2,4", "chain:1 (training eval)",
                                         "chain:3 (training eval)") for k in (1, 3, 4)}
    evals = {int(row["step"]): row for row in read_csv(os.path.join(workdir, "eval.csv"))}
    for (series, step), p in got.items():
        assert p["tokens"] == row_tokens(workdir, step) == 8 * 64 * step  # rows x length x steps
        if "training eval" in series:
            assert p["tau"] == pytest.approx(evals[step][f"decode_tau/chain{series[6]}"])
        else:
            assert p["lossless"] is True and 1.0 <= p["tau"] <= 3.0 and p["tau_lo"] <= p["tau"] <= p["tau_hi"]
    assert got[("chain:2", 1)]["tokens"] < got[("chain:2", 3)]["tokens"] < got[("chain:2", 4)]["tokens"]
    out = tmp / "curve"
    r = subprocess.run([sys.executable, "-m", "launch.scaling_curve", "fit", "--points", str(points),
                        "--tokens_per_s", "eagle3=50", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    fits = json.loads((tmp / "curve.json").read_text())["fits"]
    assert set(fits) == {"eagle3|chain:2", "eagle3|dynamic:2,2,4", "eagle3|chain:1 (training eval)",
                         "eagle3|chain:3 (training eval)"}
    assert (tmp / "curve.png").stat().st_size > 5000 and "| eagle3 | chain:2 |" in (tmp / "curve.md").read_text()
    # a run that came back without its checkpoints (the GPU campaign): the training evaluation alone
    bare = tmp / "bare"
    bare.mkdir()
    for f in ("config.json", "metrics.csv", "eval.csv"):
        (bare / f).write_bytes(open(os.path.join(workdir, f), "rb").read())
    r = subprocess.run([sys.executable, "-m", "launch.scaling_curve", "measure", "--runs", f"eagle3={bare}",
                        "--budgets", "", "--out", str(tmp / "bare.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    bare_points = json.loads((tmp / "bare.json").read_text())["points"]
    assert sorted((p["series"], p["step"], p["tau"]) for p in bare_points) == sorted(
        (s, k, p["tau"]) for (s, k), p in got.items() if s == "chain:3 (training eval)")
    r = subprocess.run([sys.executable, "-m", "launch.scaling_curve", "measure", "--runs", f"eagle3={workdir}",
                        "--steps", "2", "--budgets", "", "--out", str(tmp / "x.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "evaluated (eval.csv) at steps [1, 3, 4]" in r.stderr, r.stderr[-2000:]
