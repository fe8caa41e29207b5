"""Bootstrap confidence intervals for the benchmark metrics, with the *question* as the unit.

Why questions and not passes: passes of one answer are correlated (an easy answer accepts long
chains all the way through), so resampling passes would give intervals far too narrow. The paper's
claim "ConFu accepts more than EAGLE-3" is a claim about questions drawn from a population of
prompts; resampling questions with replacement (Efron's percentile bootstrap) estimates how much the
figure would move on another draw of them.

* A category's interval resamples that category's questions.
* The overall ("AVG") interval resamples *within each category* (stratified): the benchmark fixes how
  many questions each category has (MT-Bench: 10), so that proportion is not random. With a category
  of a single question it resamples all questions freely instead (a stratum of one never varies).
* A group of fewer than two questions gets no interval (nan, shown as "–").
* Ratios are *paired*: the speed-up resamples one set of question ids and evaluates the method and
  the AR baseline on the same ids; the ConFu / EAGLE-3 τ ratio likewise. Pairing removes the
  per-question difficulty that both sides share, which is what makes small differences resolvable.

The statistics are the ones of :mod:`confu_jax.bench.metrics`: τ pooled over passes (sum of emitted
tokens / number of passes over the resampled questions, Spec-Bench's definition), tokens/s the mean of
per-question speeds, speed-up the ratio of those means.

Each results row carries ``questions``: ``{question_id: {category, emitted, passes, tokens, seconds}}``
(turns summed), from which every interval here can be recomputed, and the intervals themselves as
``[low, high]`` pairs (``tau_ci``, ``speedup_ci``, ``tokens_per_s_ci``).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

DEFAULT_N_BOOT = 2000  # Monte-Carlo error of a 95% percentile endpoint ~ 0.5% of the interval's width
DEFAULT_LEVEL = 0.95


def question_table(logs: Iterable) -> dict:
    """``{question_id: {category, emitted, passes, tokens, seconds}}`` from GenerationLogs (turns summed).

    ``emitted`` / ``passes`` are the verification passes' emitted tokens and count (τ's numerator and
    denominator); ``tokens`` / ``seconds`` the question's tokens and wall time (its speed).
    """
    table: dict = {}
    for g in logs:
        q = table.setdefault(g.question_id, {"category": g.category, "emitted": 0, "passes": 0,
                                             "tokens": 0, "seconds": 0.0})
        q["emitted"] += int(sum(g.accept_lengths))
        q["passes"] += len(g.accept_lengths)
        q["tokens"] += int(g.new_tokens)
        q["seconds"] += float(g.wall_s)
    return table


MIN_QUESTIONS = 2  # fewer questions in a group: no interval (a resample of one question never varies)


def resample_indices(categories: Sequence[str], n_boot: int, seed: int, stratified: bool) -> np.ndarray:
    """[n_boot, n] indices into the questions: uniform with replacement, or within each category.

    Stratifying needs at least two questions in every category (a category of one would be
    resampled as itself, hiding its variance): otherwise the questions are resampled freely."""
    rng = np.random.default_rng(seed)
    n = len(categories)
    counts = {c: list(categories).count(c) for c in dict.fromkeys(categories)}
    if not stratified or min(counts.values(), default=0) < MIN_QUESTIONS:
        return rng.integers(0, n, size=(n_boot, n))
    cats = np.asarray(categories)
    out = np.empty((n_boot, n), dtype=np.int64)
    for c in dict.fromkeys(categories):
        members = np.flatnonzero(cats == c)
        out[:, members] = members[rng.integers(0, members.size, size=(n_boot, members.size))]
    return out


def _interval(samples: np.ndarray, level: float) -> list[float]:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return [float("nan"), float("nan")]
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def _columns(table: Mapping, ids: Sequence, *names: str) -> list[np.ndarray]:
    return [np.array([table[q][k] for q in ids], dtype=np.float64) for k in names]


def _ids(table: Mapping, category: str | None) -> list:
    return [q for q, row in table.items() if category is None or row["category"] == category]


def tau_interval(table: Mapping, category: str | None = None, *, n_boot: int = DEFAULT_N_BOOT,
                 seed: int = 0, level: float = DEFAULT_LEVEL) -> list[float]:
    """Percentile interval of pooled τ over the questions of ``category`` (None: all, stratified)."""
    ids = _ids(table, category)
    if len(ids) < MIN_QUESTIONS:
        return [float("nan"), float("nan")]
    emitted, passes = _columns(table, ids, "emitted", "passes")
    idx = resample_indices([table[q]["category"] for q in ids], n_boot, seed, stratified=category is None)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _interval(emitted[idx].sum(1) / passes[idx].sum(1), level)


def speedup_interval(table: Mapping, baseline: Mapping, category: str | None = None, *,
                     n_boot: int = DEFAULT_N_BOOT, seed: int = 0, level: float = DEFAULT_LEVEL):
    """-> (speed-up interval, tokens/s interval): the method and the AR ``baseline`` on the same
    resampled question ids (paired). Both tables must hold the same questions."""
    ids = _ids(table, category)
    missing = [q for q in ids if q not in baseline]
    if missing:
        raise ValueError(f"speedup_interval: the baseline lacks questions {missing[:5]} of the method")
    if len(ids) < MIN_QUESTIONS:
        nan = [float("nan"), float("nan")]
        return nan, nan
    tokens, seconds = _columns(table, ids, "tokens", "seconds")
    b_tokens, b_seconds = _columns(baseline, ids, "tokens", "seconds")
    idx = resample_indices([table[q]["category"] for q in ids], n_boot, seed, stratified=category is None)
    speed = (tokens / seconds)[idx].mean(1)
    base = (b_tokens / b_seconds)[idx].mean(1)
    return _interval(speed / base, level), _interval(speed, level)


def tau_ratio(table: Mapping, reference: Mapping, category: str | None = None, *,
              n_boot: int = DEFAULT_N_BOOT, seed: int = 0, level: float = DEFAULT_LEVEL) -> dict:
    """τ(table) / τ(reference) over the questions both ran, with its paired percentile interval."""
    ids = [q for q in _ids(table, category) if q in reference]
    if not ids:
        return {"ratio": float("nan"), "ci": [float("nan"), float("nan")], "n_questions": 0}
    e, p = _columns(table, ids, "emitted", "passes")
    re, rp = _columns(reference, ids, "emitted", "passes")
    if len(ids) < MIN_QUESTIONS:
        return {"ratio": float((e.sum() / p.sum()) / (re.sum() / rp.sum())), "ci": [float("nan"), float("nan")],
                "n_questions": len(ids)}
    idx = resample_indices([table[q]["category"] for q in ids], n_boot, seed, stratified=category is None)
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (e[idx].sum(1) / p[idx].sum(1)) / (re[idx].sum(1) / rp[idx].sum(1))
    return {"ratio": float((e.sum() / p.sum()) / (re.sum() / rp.sum())), "ci": _interval(boot, level),
            "n_questions": len(ids)}


def accepted_ratio(table: Mapping, reference: Mapping, category: str | None = None, *,
                   n_boot: int = DEFAULT_N_BOOT, seed: int = 0, level: float = DEFAULT_LEVEL) -> dict:
    """(τ(table) − 1) / (τ(reference) − 1): the ratio of drafted tokens accepted per pass (the bonus
    token every pass emits left out; the SD² paper's "+22% accepted tokens"), paired by question as
    ``tau_ratio``."""
    ids = [q for q in _ids(table, category) if q in reference]
    if not ids:
        return {"ratio": float("nan"), "ci": [float("nan"), float("nan")], "n_questions": 0}
    e, p = _columns(table, ids, "emitted", "passes")
    re, rp = _columns(reference, ids, "emitted", "passes")

    def ratio(e_, p_, re_, rp_):
        with np.errstate(invalid="ignore", divide="ignore"):
            return (e_.sum(-1) / p_.sum(-1) - 1.0) / (re_.sum(-1) / rp_.sum(-1) - 1.0)

    point = float(ratio(e, p, re, rp))
    if len(ids) < MIN_QUESTIONS:
        return {"ratio": point, "ci": [float("nan"), float("nan")], "n_questions": len(ids)}
    idx = resample_indices([table[q]["category"] for q in ids], n_boot, seed, stratified=category is None)
    return {"ratio": point, "ci": _interval(ratio(e[idx], p[idx], re[idx], rp[idx]), level),
            "n_questions": len(ids)}


def annotate(row: dict, logs: Sequence, baseline_logs: Sequence, *, n_boot: int = DEFAULT_N_BOOT,
             seed: int = 0, level: float = DEFAULT_LEVEL) -> dict:
    """Add ``questions`` and the ``*_ci`` intervals (overall and per category) to a results row."""
    table, base = question_table(logs), question_table(baseline_logs)
    row["questions"] = {str(q): v for q, v in table.items()}
    row["ci_level"] = level
    row["tau_ci"] = tau_interval(table, None, n_boot=n_boot, seed=seed, level=level)
    row["speedup_ci"], row["tokens_per_s_ci"] = speedup_interval(table, base, None, n_boot=n_boot, seed=seed,
                                                                 level=level)
    for c, cat in row["per_category"].items():
        cat = dict(cat) if not isinstance(cat, dict) else cat
        cat["tau_ci"] = tau_interval(table, c, n_boot=n_boot, seed=seed, level=level)
        cat["speedup_ci"], cat["tokens_per_s_ci"] = speedup_interval(table, base, c, n_boot=n_boot, seed=seed,
                                                                     level=level)
        row["per_category"][c] = cat
    return row


def ratio_rows(rows: Sequence[Mapping], numerator: str = "confu", denominator: str = "eagle3", *,
               n_boot: int = DEFAULT_N_BOOT, seed: int = 0, level: float = DEFAULT_LEVEL) -> list[dict]:
    """τ ratio of every ``numerator``-like method (confu, its ablations) to ``denominator`` at the same
    temperature and budget, overall and per category, from the rows' ``questions``."""
    out = []
    for r in rows:
        if not str(r["method"]).startswith(numerator) or "questions" not in r:
            continue
        ref = next((d for d in rows if d["method"] == denominator and d["temperature"] == r["temperature"]
                    and d.get("budget") == r.get("budget") and "questions" in d), None)
        if ref is None:
            continue
        cats = list(r["per_category"])
        out.append({
            "method": r["method"], "reference": denominator, "temperature": r["temperature"],
            "budget": r.get("budget"),
            "overall": tau_ratio(r["questions"], ref["questions"], None, n_boot=n_boot, seed=seed, level=level),
            "per_category": {c: tau_ratio(r["questions"], ref["questions"], c, n_boot=n_boot, seed=seed,
                                          level=level) for c in cats},
        })
    return out
