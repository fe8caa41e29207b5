"""Bootstrap intervals over questions (confu_jax.bench.intervals): scipy.stats.bootstrap as the
reference for the plain percentile intervals, exact properties for the stratified and paired ones."""

import json

import numpy as np
import pytest
import scipy.stats

from confu_jax.bench import intervals, report
from confu_jax.bench.metrics import GenerationLog, summarize

N_BOOT = 20000


def _logs(rng, n_per_cat=12, cats=("writing", "coding"), mean_accept=1.5, speed=20.0):
    """Random per-question logs: a question's passes accept ~Poisson lengths, its speed varies."""
    logs, ar = [], []
    for c in cats:
        for i in range(n_per_cat):
            qid = f"{c}-{i}"
            lam = rng.uniform(0.2, 2 * (mean_accept - 1))
            acc = 1 + rng.poisson(lam, size=rng.integers(10, 40))
            tokens = int(acc.sum()) + 1
            logs.append(GenerationLog(qid, c, tuple(int(a) for a in acc), tokens, tokens / (speed * rng.uniform(0.6, 1.4))))
            ar.append(GenerationLog.autoregressive(qid, c, tokens, tokens / (speed * rng.uniform(0.5, 0.7))))
    return logs, ar


def _close_interval(ours, ref, width_frac=0.06):
    """Two Monte-Carlo percentile intervals of N_BOOT resamples agree to a few % of their width."""
    width = ref[1] - ref[0]
    assert width > 0
    assert abs(ours[0] - ref[0]) < width_frac * width and abs(ours[1] - ref[1]) < width_frac * width, (ours, ref)


def test_category_intervals_match_scipy_bootstrap():
    rng = np.random.default_rng(0)
    logs, ar = _logs(rng)
    table, base = intervals.question_table(logs), intervals.question_table(ar)
    ids = [q for q in table if table[q]["category"] == "coding"]
    emitted = np.array([table[q]["emitted"] for q in ids], float)
    passes = np.array([table[q]["passes"] for q in ids], float)
    speed = np.array([table[q]["tokens"] / table[q]["seconds"] for q in ids])
    base_speed = np.array([base[q]["tokens"] / base[q]["seconds"] for q in ids])

    ref_tau = scipy.stats.bootstrap((emitted, passes), lambda e, p, axis: e.sum(axis) / p.sum(axis), paired=True,
                                    vectorized=True, n_resamples=N_BOOT, method="percentile", random_state=1)
    _close_interval(intervals.tau_interval(table, "coding", n_boot=N_BOOT), ref_tau.confidence_interval)

    ref_sr = scipy.stats.bootstrap((speed, base_speed), lambda a, b, axis: a.mean(axis) / b.mean(axis), paired=True,
                                   vectorized=True, n_resamples=N_BOOT, method="percentile", random_state=1)
    sr_ci, tps_ci = intervals.speedup_interval(table, base, "coding", n_boot=N_BOOT)
    _close_interval(sr_ci, ref_sr.confidence_interval)
    ref_tps = scipy.stats.bootstrap((speed,), np.mean, n_resamples=N_BOOT, method="percentile", random_state=1)
    _close_interval(tps_ci, ref_tps.confidence_interval)


def test_tau_ratio_is_paired_and_matches_scipy():
    rng = np.random.default_rng(1)
    a_logs, _ = _logs(rng, cats=("stem",), n_per_cat=16)
    table = intervals.question_table(a_logs)
    # the method against itself: a ratio of exactly 1 in every resample (pairing), not a wide interval
    same = intervals.tau_ratio(table, table)
    assert same["ratio"] == pytest.approx(1.0) and same["ci"] == pytest.approx([1.0, 1.0])
    b_logs, _ = _logs(np.random.default_rng(2), cats=("stem",), n_per_cat=16, mean_accept=1.3)
    ref = intervals.question_table(b_logs)
    ids = list(table)
    cols = [np.array([t[q][k] for q in ids], float) for t in (table, ref) for k in ("emitted", "passes")]
    r = scipy.stats.bootstrap(cols, lambda e, p, re, rp, axis: (e.sum(axis) / p.sum(axis)) / (re.sum(axis) / rp.sum(axis)),
                              paired=True, vectorized=True, n_resamples=N_BOOT, method="percentile", random_state=3)
    ours = intervals.tau_ratio(table, ref, "stem", n_boot=N_BOOT)
    _close_interval(ours["ci"], r.confidence_interval)
    assert ours["ratio"] == pytest.approx((cols[0].sum() / cols[1].sum()) / (cols[2].sum() / cols[3].sum()))
    assert ours["n_questions"] == 16


def test_overall_interval_resamples_within_categories():
    cats = ["a"] * 5 + ["b"] * 3 + ["c"] * 7
    idx = intervals.resample_indices(cats, 500, seed=0, stratified=True)
    assert idx.shape == (500, 15)
    arr = np.asarray(cats)
    assert (arr[idx] == arr[None, :]).all()  # every slot draws from its own category
    # constant within each category but different across: the stratified overall τ cannot move,
    # while resampling questions freely would mix the categories in random proportions
    table = {}
    for i, c in enumerate(cats):
        e = {"a": 10, "b": 30, "c": 20}[c]
        table[i] = {"category": c, "emitted": e, "passes": 10, "tokens": e + 1, "seconds": 1.0}
    point = sum(r["emitted"] for r in table.values()) / sum(r["passes"] for r in table.values())
    assert intervals.tau_interval(table, None) == pytest.approx([point, point])
    free = intervals.resample_indices(cats, 500, seed=0, stratified=False)
    emitted = np.array([table[i]["emitted"] for i in range(15)], float)
    assert np.ptp(emitted[free].sum(1)) > 0


def test_annotated_rows_write_intervals_ratios_table_and_figure(tmp_path):
    rng = np.random.default_rng(3)
    e3_logs, ar_logs = _logs(rng, mean_accept=1.4)
    confu_logs = [GenerationLog(g.question_id, g.category, tuple(a + (i % 3 == 0) for i, a in enumerate(g.accept_lengths)),
                                g.new_tokens + sum(1 for i in range(len(g.accept_lengths)) if i % 3 == 0), g.wall_s)
                  for g in e3_logs]
    rows = []
    for name, logs in (("ar", ar_logs), ("eagle3", e3_logs), ("confu", confu_logs)):
        import dataclasses
        row = dict(dataclasses.asdict(summarize(name, logs, ar_logs, nodes=None if name == "ar" else 4)),
                   budget=None if name == "ar" else "chain:3")
        rows.append(intervals.annotate(row, logs, ar_logs))
    ar_row, e3_row, confu_row = rows
    assert ar_row["speedup_ci"] == pytest.approx([1.0, 1.0])  # AR against itself, paired
    for r in rows:
        assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1]
        assert r["speedup_ci"][0] <= r["speedup"] <= r["speedup_ci"][1]
        for c in r["per_category"].values():
            assert c["tau_ci"][0] <= c["tau"] <= c["tau_ci"][1]
    out = tmp_path / "b.json"
    report.write_outputs(str(out), rows)
    doc = json.loads(out.read_text())
    (ratio,) = doc["tau_ratios"]
    assert ratio["method"] == "confu" and ratio["reference"] == "eagle3"
    assert ratio["overall"]["ratio"] == pytest.approx(confu_row["tau"] / e3_row["tau"])
    assert ratio["overall"]["ci"][0] > 1.0  # every question of confu accepts more: the interval says so
    assert set(doc["results"][1]["questions"]) == {str(g.question_id) for g in e3_logs}
    md = (tmp_path / "b.md").read_text()
    assert "τ confu / τ eagle3" in md and "[95% CI]" in md
    fig = report.plot_tau_speedup(rows, tmp_path / "f.png")
    assert len(fig.axes) == 2
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert heights[-1] == pytest.approx(confu_row["speedup"])


def test_single_question_groups_get_no_interval_and_no_degenerate_stratification():
    """One question per category (the quickstart's 8 questions): per-category intervals are nan, and
    the overall interval resamples the questions freely (strata of one would never vary)."""
    rng = np.random.default_rng(5)
    logs, ar = _logs(rng, n_per_cat=1, cats=("a", "b", "c", "d", "e", "f"))
    table, base = intervals.question_table(logs), intervals.question_table(ar)
    assert all(np.isnan(intervals.tau_interval(table, c)).all() for c in "abcdef")
    lo, hi = intervals.tau_interval(table, None)
    assert lo < hi
    sr, _ = intervals.speedup_interval(table, base, "a")
    assert np.isnan(sr).all()
    r = intervals.tau_ratio(table, table, "a")
    assert r["ratio"] == pytest.approx(1.0) and np.isnan(r["ci"]).all()


def test_accepted_ratio_matches_scipy_and_tau_compare_reads_two_outputs(tmp_path):
    """(τ−1) ratio, paired by question, against scipy's paired bootstrap; ``launch.tau_compare`` finds
    the rows in two results files and pairs only the questions both ran."""
    from confu_jax.bench import compare as tc

    rng = np.random.default_rng(4)
    a_logs, _ = _logs(rng, cats=("stem",), n_per_cat=16)
    b_logs, _ = _logs(np.random.default_rng(5), cats=("stem",), n_per_cat=16, mean_accept=1.3)
    table, ref = intervals.question_table(a_logs), intervals.question_table(b_logs)
    same = intervals.accepted_ratio(table, table)
    assert same["ratio"] == pytest.approx(1.0) and same["ci"] == pytest.approx([1.0, 1.0])
    ids = list(table)
    cols = [np.array([t[q][k] for q in ids], float) for t in (table, ref) for k in ("emitted", "passes")]
    fn = lambda e, p, re, rp, axis: (e.sum(axis) / p.sum(axis) - 1) / (re.sum(axis) / rp.sum(axis) - 1)  # noqa: E731
    r = scipy.stats.bootstrap(cols, fn, paired=True, vectorized=True, n_resamples=N_BOOT, method="percentile",
                              random_state=3)
    ours = intervals.accepted_ratio(table, ref, "stem", n_boot=N_BOOT)
    _close_interval(ours["ci"], r.confidence_interval)
    assert ours["ratio"] == pytest.approx(float(fn(*cols, axis=0)))

    q_a = {str(q): v for q, v in table.items()}
    q_b = {str(q): v for q, v in ref.items() if q != ids[0]}  # the reference lacks one question
    for name, method, q in (("a.json", "sd2", q_a), ("b.json", "draft_model", q_b)):
        rows = [{"method": method, "temperature": 0.0, "budget": "chain:4", "questions": q},
                {"method": method, "temperature": 1.0, "budget": "chain:4", "questions": q}]
        (tmp_path / name).write_text(json.dumps({"results": rows}))
    out = tc.compare(tc.find_row(str(tmp_path / "a.json"), "sd2", 0.0, "chain:4"),
                     tc.find_row(str(tmp_path / "b.json"), "draft_model", 0.0), n_boot=500)
    assert out["n_questions"] == 15
    common = {q: table[q] for q in ids[1:]}
    assert out["tau"]["row"] == pytest.approx(sum(v["emitted"] for v in common.values())
                                              / sum(v["passes"] for v in common.values()))
    with pytest.raises(ValueError, match="expected one row"):
        tc.find_row(str(tmp_path / "a.json"), "sd2", 0.5)
