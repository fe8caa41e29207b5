"""Scaling curves: held-out τ against tokens seen, the log-linear fit, and what a τ goal would cost.

A point is one checkpoint of a training run (``train.milestones`` keeps them) measured one way:
decoded τ on held-out questions at a budget (``bench.spec_bench.checkpoint_rows``), or the
training evaluation's ``decode_tau/chain{D}`` (τ along the greedy chain-D decode path of the 64
held-out conversations, ``train.acceptance.decode_path_acceptance_length``: exact for greedy chain
decoding of the target's own greedy text). ``tokens`` is what the head has seen up to that step,
ancestors included (``runs.lineage``): the tokens of its training batches by default, the same for
every head trained on the same batches, or its trained answer positions.

The fit is τ = a + b·log10(tokens) by least squares — the form the EAGLE papers' data-scaling
tables follow over the range they cover — with a 95% confidence band for the mean line. The tokens
a goal τ would take is where the fitted line reaches it; its interval is where the band's upper and
lower edges reach it (the inverse of the band: Fieller's interval for a calibration line). That is an
extrapolation from the measured range, stated with the range; τ is also bounded by the plan's depth
+ 1 (chain:3 ≤ 4), which a log-linear line ignores, so a goal near the bound is optimistic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Sequence

import numpy as np

from confu_jax import storage


@dataclasses.dataclass(frozen=True, kw_only=True)
class Point:
    """One checkpoint measured one way."""

    method: str  # eagle3 | confu | ...
    series: str  # how τ was measured, e.g. 'chain:3', 'dynamic:6,10,60', 'chain:3 (training eval)'
    step: int
    tokens: float  # tokens seen up to ``step`` (ancestors included)
    tau: float
    tau_lo: float = float("nan")  # 95% interval (nan: none, e.g. the training evaluation's mean)
    tau_hi: float = float("nan")
    lossless: Optional[bool] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogFit:
    """τ = a + b·log10(tokens) fitted to ``n`` points spanning ``tokens_range``."""

    a: float
    b: float
    cov: tuple  # 2×2 covariance of (a, b), row-major
    dof: int  # n − 2
    sigma: float  # residual standard deviation
    n: int
    tokens_range: tuple  # (smallest, largest) tokens measured

    def predict(self, tokens) -> np.ndarray:
        return self.a + self.b * np.log10(np.asarray(tokens, np.float64))

    def band(self, tokens, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Confidence band of the mean line at ``tokens`` (t quantile with ``dof`` degrees)."""
        x = np.log10(np.asarray(tokens, np.float64))
        c = np.asarray(self.cov).reshape(2, 2)
        se = np.sqrt(np.maximum(c[0, 0] + 2 * x * c[0, 1] + x * x * c[1, 1], 0.0))
        half = t_quantile(0.5 + level / 2, self.dof) * se
        mid = self.predict(tokens)
        return mid - half, mid + half


def t_quantile(p: float, dof: int) -> float:
    """Student-t quantile (scipy: a dependency of jax itself); infinite for ``dof`` < 1 (two points
    give a line but no interval)."""
    if dof < 1:
        return math.inf
    from scipy import stats

    return float(stats.t.ppf(p, dof))


def fit_log_linear(tokens: Sequence[float], tau: Sequence[float]) -> LogFit:
    """Ordinary least squares of τ on log10(tokens); at least 2 points at 2 distinct token counts."""
    t = np.asarray(tokens, np.float64)
    y = np.asarray(tau, np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"tokens and tau: expected two equal-length lists, got shapes {t.shape} and {y.shape}")
    if np.any(t <= 0):
        raise ValueError(f"tokens must be > 0 (log axis), got {sorted(t.tolist())[:3]}")
    x = np.log10(t)
    if len(np.unique(x)) < 2:
        raise ValueError(f"a line needs points at >= 2 distinct token counts, got {sorted(set(t.tolist()))}")
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = len(x) - 2
    sigma = float(np.sqrt(resid @ resid / dof)) if dof > 0 else float("nan")
    cov = (np.linalg.inv(design.T @ design) * sigma ** 2) if dof > 0 else np.full((2, 2), np.nan)
    return LogFit(a=float(coef[0]), b=float(coef[1]), cov=tuple(float(v) for v in cov.ravel()), dof=dof,
                  sigma=sigma, n=len(x), tokens_range=(float(t.min()), float(t.max())))


def tokens_for(fit: LogFit, goal: float, level: float = 0.95, max_log10: float = 30.0) -> dict:
    """Tokens seen at which the fitted line reaches τ ``goal``, and the interval where the
    confidence band's edges reach it: {'tokens', 'lo', 'hi'} (inf: not reached below 10^max_log10,
    or the line does not rise)."""
    est = 10 ** ((goal - fit.a) / fit.b) if fit.b > 0 and (goal - fit.a) / fit.b < max_log10 else math.inf
    grid = np.logspace(0, max_log10, 3001)
    lo_band, hi_band = fit.band(grid, level)

    def first(reached: np.ndarray) -> float:
        idx = np.flatnonzero(reached)
        return float(grid[idx[0]]) if idx.size else math.inf

    # the earliest the goal is plausible (upper edge reaches it), the latest (lower edge reaches it)
    return {"tokens": float(est), "lo": first(hi_band >= goal), "hi": first(lo_band >= goal)}


def group(points: Iterable[Point]) -> dict:
    """{(method, series): [points sorted by tokens]}."""
    out: dict = {}
    for p in points:
        out.setdefault((p.method, p.series), []).append(p)
    return {k: sorted(v, key=lambda p: p.tokens) for k, v in out.items()}


def fmt_tokens(n: float) -> str:
    if not math.isfinite(n):
        return "∞"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def table(points: Sequence[Point], goals: Sequence[float] = (2.0, 2.5, 3.0),
          tokens_per_s: Optional[dict] = None, min_tokens: float = 0.0) -> tuple[str, dict]:
    """Markdown: one block of points per (method, series), then one line per fit with the tokens
    (and, given ``tokens_per_s`` {method: rate}, hours at that rate) each goal τ would take.
    Points below ``min_tokens`` are listed but not fitted. Returns (markdown, fits
    {'method|series': LogFit as dict with the goals})."""
    groups = group(points)
    lines = ["| method | measured | step | tokens seen | τ [95% CI] | lossless |", "|---|---|---|---|---|---|"]
    for (m, s), pts in groups.items():
        for p in pts:
            ci = "" if math.isnan(p.tau_lo) else f" [{p.tau_lo:.3f}, {p.tau_hi:.3f}]"
            lossless = {None: "", True: "yes", False: "**no**"}[p.lossless]
            lines.append(f"| {m} | {s} | {p.step} | {fmt_tokens(p.tokens)} | {p.tau:.3f}{ci} | {lossless} |")
    head = ["| method | measured | fit τ = a + b·log10(tokens) | points (range) |"
            + "".join(f" tokens for τ {g:g} [95%] |" for g in goals),
            "|---|---|---|---|" + "---|" * len(goals)]
    fits = {}
    for (m, s), pts in groups.items():
        pts = [p for p in pts if p.tokens >= min_tokens]
        if len({p.tokens for p in pts}) < 2:
            continue
        f = fit_log_linear([p.tokens for p in pts], [p.tau for p in pts])
        se_b = math.sqrt(f.cov[3]) if f.dof > 0 else float("nan")
        cells, goal_info = [], {}
        for g in goals:
            r = tokens_for(f, g)
            goal_info[str(g)] = r
            cell = f"{fmt_tokens(r['tokens'])} [{fmt_tokens(r['lo'])}, {fmt_tokens(r['hi'])}]"
            rate = (tokens_per_s or {}).get(m)
            if rate and math.isfinite(r["tokens"]):
                hours = r["tokens"] / rate / 3600
                cell += f" ≈ {hours:.3g} h" if hours < 1e5 else f" ≈ {hours / 8766:.3g} years"
            cells.append(cell)
        fits[f"{m}|{s}"] = dict(dataclasses.asdict(f), goals=goal_info, se_b=se_b)
        head.append(f"| {m} | {s} | {f.a:.3f} + {f.b:.4f}·log10(t) (slope s.e. {se_b:.4f}) | {f.n} "
                    f"({fmt_tokens(f.tokens_range[0])}–{fmt_tokens(f.tokens_range[1])}) |" + "".join(f" {c} |" for c in cells))
    return "\n".join(lines) + "\n\n" + "\n".join(head) + "\n", fits


def figure(points: Sequence[Point], path: str, goals: Sequence[float] = (2.0, 2.5, 3.0),
           min_tokens: float = 0.0) -> None:
    """τ against tokens seen (log axis), one colour per method and one marker per series, each with
    its fitted line (points from ``min_tokens`` on) and band extended a decade past the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group(points)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = {}
    markers = ["o", "s", "^", "D", "v"]
    series = sorted({s for _, s in groups})
    for (m, s), pts in groups.items():
        colour = colours.setdefault(m, f"C{len(colours)}")
        x = np.array([p.tokens for p in pts])
        y = np.array([p.tau for p in pts])
        lo = np.array([p.tau_lo for p in pts])
        hi = np.array([p.tau_hi for p in pts])
        err = None if np.all(np.isnan(lo)) else np.stack([y - lo, hi - y])
        ax.errorbar(x, y, yerr=err, fmt=markers[series.index(s) % len(markers)], color=colour, capsize=2,
                    label=f"{m}, {s}")
        keep = x >= min_tokens
        if len(set(x[keep].tolist())) >= 2:
            f = fit_log_linear(x[keep], y[keep])
            grid = np.logspace(np.log10(x[keep].min()), np.log10(x.max()) + 1, 50)
            ax.plot(grid, f.predict(grid), "-" if "eval" not in s else ":", color=colour, lw=1)
            if f.dof > 0:
                b_lo, b_hi = f.band(grid)
                ax.fill_between(grid, b_lo, b_hi, color=colour, alpha=0.08)
    for g in goals:
        ax.axhline(g, color="grey", lw=0.5, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("held-out τ (tokens per target pass)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=120)  # a local file or gs://
    plt.close(fig)
