"""Benchmark outputs: ``results.json``, a markdown table in the ConFu paper's layout, a τ figure.

``results.json`` layout::

    {"environment": {jax_version, devices, cpu_count, git_commit, date_utc, command_line, ...},
     "results": [{"method", "nodes", "temperature", "setting", "tau", "tokens_per_s", "speedup",
                  "per_category": {name: {"tau", "speedup", "tokens_per_s", "n_questions"}},
                  "n_questions", "n_target_passes", "new_tokens", "wall_s",
                  "accept_length_histogram", "acceptance_rate_per_depth"}, ...]}

One entry per (method, setting). Metric definitions are in :mod:`confu_jax.bench.metrics`.
Rows from ``spec_bench`` also carry ``questions`` (per-question counts) and 95% bootstrap intervals
over questions (``tau_ci``, ``speedup_ci``, ``tokens_per_s_ci``, overall and per category), and the
document a top-level ``tau_ratios`` list (ConFu-like methods over EAGLE-3, and SD² over the unsteered
draft model, at the same temperature and budget, with paired intervals): :mod:`confu_jax.bench.intervals`. When the benchmark kept its units in
``<out>.parts/``, a top-level ``tau_breakdown`` list holds each speculative row's τ by answer position
and by prompt source (:mod:`confu_jax.bench.breakdown`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from typing import Mapping, Sequence

from confu_jax import storage
from confu_jax.bench.metrics import MethodResult

REQUIRED_RESULT_FIELDS = ("method", "nodes", "temperature", "tau", "tokens_per_s", "speedup",
                          "per_category")
REQUIRED_CATEGORY_FIELDS = ("tau", "speedup")
REQUIRED_ENV_FIELDS = ("jax_version", "devices", "cpu_count", "git_commit", "date_utc",
                       "command_line")

# The paper's column abbreviations (Tables 1-3); unknown categories are shown upper-cased.
CATEGORY_ABBREV = {
    "writing": "WRIT", "roleplay": "RP", "coding": "CODE", "extraction": "EXT", "stem": "STEM",
    "humanities": "HUM", "summarization": "SUMM", "translation": "TRAN", "qa": "QA", "rag": "RAG",
    "math_reasoning": "M/R", "math": "MATH", "reasoning": "REAS", "humaneval": "HE",
}
# Column order of the paper, then MT-Bench's math and reasoning (which Spec-Bench merges into M/R).
CATEGORY_ORDER = ("writing", "roleplay", "coding", "extraction", "stem", "humanities",
                  "summarization", "translation", "qa", "rag", "math_reasoning", "math", "reasoning",
                  "humaneval")


def result_to_json(result: MethodResult | Mapping) -> dict:
    """A MethodResult (or an already-JSON dict) as plain JSON types; nan becomes null."""
    obj = dataclasses.asdict(result) if isinstance(result, MethodResult) else dict(result)
    return _json_clean(obj)


def _json_clean(x):
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Mapping):
        return {str(k): _json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _json_clean(x.item())
    return x


def _check_result(obj: Mapping, index: int) -> None:
    missing = [k for k in REQUIRED_RESULT_FIELDS if k not in obj]
    if missing:
        raise ValueError(f"results[{index}] ({obj.get('method')!r}): missing field(s) {missing}; "
                         f"required {list(REQUIRED_RESULT_FIELDS)}")
    for name, cat in obj["per_category"].items():
        cat_missing = [k for k in REQUIRED_CATEGORY_FIELDS if k not in cat]
        if cat_missing:
            raise ValueError(f"results[{index}].per_category[{name!r}]: missing {cat_missing}")


# the vector extensions that set much of XLA:CPU's speed, widest first: two hosts of this project's
# development machine measured AR decoding ~3x apart (docs/RESULTS.md, fifth loan), and results files
# that did not name the processor could not say why
_CPU_ISA = ("amx_tile", "avx512_bf16", "avx512f", "avx2", "avx", "sse4_2", "asimd", "sve")


def cpu_description(cpuinfo: str) -> dict:
    """{'cpu_model', 'cpu_isa'} from the text of Linux's /proc/cpuinfo (first processor): the model
    name and which of ``_CPU_ISA`` its flags list, so two results files say whether they were timed
    on the same kind of processor; None for what the text does not say."""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if model is None and key in ("model name", "cpu model", "hardware"):
            model = value.strip() or None
        elif flags is None and key in ("flags", "features"):
            flags = set(value.split())
        if model is not None and flags is not None:
            break
    isa = None if flags is None else [f for f in _CPU_ISA if f in flags]
    return {"cpu_model": model, "cpu_isa": isa}


def collect_environment(argv: Sequence[str] | None = None) -> dict:
    """Where and how the numbers were measured, so a results.json can be compared or reproduced."""
    import jax
    import jaxlib

    try:
        import flax
        flax_version = flax.__version__
    except ImportError:  # pragma: no cover - flax is a runtime dependency
        flax_version = None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    try:
        cpu_affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpu_affinity = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_description(f.read())
    except OSError:  # not on Linux
        cpu = cpu_description("")
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "flax_version": flax_version,
        "backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()],
        "process_count": jax.process_count(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": cpu_affinity,
        **cpu,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": list(sys.argv if argv is None else argv),
    }


def write_results(out_path: str | os.PathLike, results: Sequence[MethodResult | Mapping],
                  env: Mapping | None = None, extra: Mapping | None = None) -> dict:
    """Write ``results.json`` (layout in the module docstring) and return what was written.

    ``env=None`` collects the environment now (:func:`collect_environment`); ``extra`` adds
    top-level keys (``tau_ratios``).
    """
    env = collect_environment() if env is None else dict(env)
    missing = [k for k in REQUIRED_ENV_FIELDS if k not in env]
    if missing:
        raise ValueError(f"write_results: environment lacks {missing}; use collect_environment()")
    rows = [result_to_json(r) for r in results]
    for i, row in enumerate(rows):
        _check_result(row, i)
    doc = {"environment": _json_clean(env), "results": rows, **_json_clean(dict(extra or {}))}
    # never leave a half-written results.json behind: tmp + rename locally, one upload on gs://
    storage.write_text(os.fspath(out_path), json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def load_results(path: str | os.PathLike) -> list[dict]:
    return json.loads(storage.read_text(os.fspath(path)))["results"]


def _rows(results) -> list[dict]:
    return [result_to_json(r) for r in results]


def ordered_categories(results) -> list[str]:
    """Every category present in any result: the paper's order first, then the rest as found."""
    present = list(dict.fromkeys(c for r in _rows(results) for c in r["per_category"]))
    known = [c for c in CATEGORY_ORDER if c in present]
    return known + [c for c in present if c not in CATEGORY_ORDER]


def _fmt(x, digits: int) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(results: Sequence[MethodResult | Mapping], digits: int = 2) -> str:
    """The paper's table: Method | Nodes | T | <category> τ | <category> SR | ... | AVG τ | AVG SR.

    AVG is the overall row pooled over all questions (metrics module), not the mean of the columns.
    A category a method was not run on shows "–".
    """
    rows = _rows(results)
    cats = ordered_categories(rows)
    header = ["Method", "Nodes", "T"]
    for c in cats + ["AVG"]:
        name = CATEGORY_ABBREV.get(c, c.upper())
        header += [f"{name} τ", f"{name} SR"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        cells = [str(r["method"]), "–" if r["nodes"] is None else str(r["nodes"]),
                 f"{r['temperature']:g}"]
        for c in cats:
            cat = r["per_category"].get(c)
            cells += ([_fmt(cat["tau"], digits), _fmt(cat["speedup"], digits)] if cat
                      else ["–", "–"])
        cells += [_fmt(r["tau"], digits), _fmt(r["speedup"], digits)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ci_cell(value, ci, digits: int) -> str:
    if not ci or ci[0] is None or (isinstance(ci[0], float) and math.isnan(ci[0])):
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} [{_fmt(ci[0], digits)}, {_fmt(ci[1], digits)}]"


def interval_table(results, digits: int = 2) -> str:
    """τ and speed-up per category with their bootstrap intervals: one line per (row, category)."""
    rows = [r for r in _rows(results) if "tau_ci" in r]
    if not rows:
        return ""
    cats = ordered_categories(rows)
    lines = ["| Method | T | Budget | Category | questions | τ [95% CI] | speed-up [95% CI] |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in cats + ["AVG"]:
            cat = r if c == "AVG" else r["per_category"].get(c)
            if cat is None:
                continue
            n = r["n_questions"] if c == "AVG" else cat.get("n_questions")
            lines.append(f"| {r['method']} | {r['temperature']:g} | {r.get('budget') or '–'} | "
                         f"{CATEGORY_ABBREV.get(c, c.upper()) if c != 'AVG' else 'AVG'} | {n} | "
                         f"{_ci_cell(cat['tau'], cat.get('tau_ci'), digits)} | "
                         f"{_ci_cell(cat['speedup'], cat.get('speedup_ci'), digits)} |")
    return "\n".join(lines) + "\n"


def ratio_table(ratios: Sequence[Mapping], digits: int = 3) -> str:
    """The τ ratios of ``intervals.ratio_rows`` (overall, then per category), with intervals."""
    if not ratios:
        return ""
    cats = list(dict.fromkeys(c for r in ratios for c in r["per_category"]))
    header = ["Ratio", "T", "Budget", "AVG"] + [CATEGORY_ABBREV.get(c, c.upper()) for c in cats]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in ratios:
        cells = [f"τ {r['method']} / τ {r['reference']}", f"{r['temperature']:g}", str(r.get("budget") or "–"),
                 _ci_cell(r["overall"]["ratio"], r["overall"]["ci"], digits)]
        for c in cats:
            x = r["per_category"].get(c)
            cells.append(_ci_cell(x["ratio"], x["ci"], digits) if x else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _errorbars(values, cis):
    """yerr rows for matplotlib from [low, high] intervals (0 where a row has none)."""
    lo, hi = [], []
    for v, ci in zip(values, cis):
        ok = ci and ci[0] is not None and not math.isnan(v) and not math.isnan(ci[0])
        lo.append(max(v - ci[0], 0.0) if ok else 0.0)
        hi.append(max(ci[1] - v, 0.0) if ok else 0.0)
    return [lo, hi]


def _bar_figure(results, caller: str, height: float):
    """The rows, their categories, the bar groups (categories + AVG), one bar's width and an empty
    Agg-backed Figure sized for them: what both per-category bar plots start from."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = _rows(results)
    if not rows:
        raise ValueError(f"{caller}: no results to plot")
    cats = ordered_categories(rows)
    groups = cats + ["AVG"]
    fig = Figure(figsize=(max(6.0, 1.1 * len(groups) + 2), height))
    FigureCanvasAgg(fig)
    return rows, cats, groups, 0.8 / len(rows), fig


def plot_tau_speedup(results: Sequence[MethodResult | Mapping], png_path: str | os.PathLike):
    """Two panels, τ and speed-up per category (and AVG), one bar per method/setting, with the rows'
    bootstrap intervals as error bars where they have them; saved as PNG. Returns the Figure."""
    rows, cats, groups, width, fig = _bar_figure(results, "plot_tau_speedup", height=7.0)
    for k, (key, ylabel) in enumerate((("tau", "τ (tokens per target pass)"),
                                       ("speedup", "speed-up over AR (same run)"))):
        ax = fig.add_subplot(2, 1, k + 1)
        for j, r in enumerate(rows):
            cells = [r["per_category"].get(c, {}) for c in cats] + [r]
            values = [math.nan if x.get(key) is None else x[key] for x in cells]
            cis = [x.get(f"{key}_ci") for x in cells]
            nodes = "" if r["nodes"] is None else f", {r['nodes']} nodes"
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, values, width=width, yerr=_errorbars(values, cis), capsize=2,
                   label=f"{r['method']}{nodes}, T={r['temperature']:g}")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([CATEGORY_ABBREV.get(c, c.upper()) for c in cats] + ["AVG"])
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # AR: 1 token per pass, speed-up 1
        if k == 0:
            ax.set_title("per category, 95% bootstrap intervals over questions")
            ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    storage.write_figure(os.fspath(png_path), fig, dpi=100, bbox_inches="tight")
    return fig


def plot_tau(results: Sequence[MethodResult | Mapping], png_path: str | os.PathLike,
             title: str = "Mean accepted length τ per category"):
    """Grouped bars of τ per category (and AVG), one bar per method/setting; saved as PNG.

    Uses the Agg canvas directly instead of ``matplotlib.use`` so importing this module never
    changes the backend of a caller's interactive session. Returns the Figure (tests read the bars).
    """
    rows, cats, groups, width, fig = _bar_figure(results, "plot_tau", height=4.0)
    ax = fig.add_subplot(1, 1, 1)
    for j, r in enumerate(rows):
        values = [r["per_category"].get(c, {}).get("tau") for c in cats] + [r["tau"]]
        values = [math.nan if v is None else v for v in values]
        nodes = "" if r["nodes"] is None else f", {r['nodes']} nodes"
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width=width, label=f"{r['method']}{nodes}, T={r['temperature']:g}")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([CATEGORY_ABBREV.get(c, c.upper()) for c in cats] + ["AVG"])
    ax.set_ylabel("τ (tokens per target pass)")
    ax.set_title(title)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # AR emits 1 token per pass
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))  # never over bars
    storage.write_figure(os.fspath(png_path), fig, dpi=100, bbox_inches="tight")
    return fig


def _breakdowns(parts_dir: str, rows: list) -> tuple[list, str]:
    """(τ breakdowns of the rows' units in ``parts_dir``, a note when they could not be read): the
    report of a long benchmark is written even if a unit there is unreadable."""
    from confu_jax.bench import breakdown

    if not storage.isdir(parts_dir):
        return [], ""
    try:
        return breakdown.breakdown_rows(breakdown.load_units(parts_dir, rows)), ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [], f"τ breakdown left out: {parts_dir} could not be read ({e})"


def write_outputs(out: str, rows: list) -> dict:
    """results.json + .md (paper table, per-row settings, intervals and τ ratios) + .png (τ and
    speed-up per category with intervals). When the benchmark kept its units (``<out>.parts/``,
    ``spec_bench.Parts``), their per-pass logs add ``tau_breakdown`` to results.json and its tables
    (τ by answer position and by prompt source, :mod:`confu_jax.bench.breakdown`) to the .md."""
    from confu_jax.bench.breakdown import markdown_tables
    from confu_jax.bench.intervals import ratio_rows

    ratios = ratio_rows(rows) + ratio_rows(rows, "sd2", "draft_model")  # SD² over its unsteered drafter
    base = os.path.splitext(out)[0]
    breakdowns, note = _breakdowns(base + ".parts", rows)
    doc = write_results(out, rows, extra={"tau_ratios": ratios, **({"tau_breakdown": breakdowns} if breakdowns else {})})
    lines = [markdown_table(rows), "", "| Method | T | Budget | Plan | Head | Lossless (T=0) | tokens/s | "
             "compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = r.get("setting", {}).get("plan", "–")
        if r.get("setting", {}).get("method"):  # method auto: the family it chose, then the plan
            plan = f"{r['setting']['method']} {plan}"
        if r.get("head") is None:
            head = "–"
        elif str(r["head"]).startswith("model-free"):
            head = str(r["head"])
        else:
            head = ("trained " if r["trained"] else "RANDOM ") + str(r["head"])
        lossless = "–" if r.get("lossless_greedy") is None else str(r["lossless_greedy"])
        if r.get("n_numerical_ties"):
            lossless += f" ({r['n_numerical_ties']} numerical ties)"
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r.get('budget') or '–'} | {plan} | {head} | "
                     f"{lossless} | {r['tokens_per_s']:.2f} | {r.get('compile_s', float('nan')):.1f} |")
    ci = interval_table(rows)
    if ci:
        lines += ["", "95% bootstrap intervals over questions (stratified by category for AVG; speed-up "
                  "paired with AR on the same questions):", "", ci]
    if ratios:
        lines += ["", "τ ratios, paired by question:", "", ratio_table(ratios)]
    if breakdowns:
        lines += ["", markdown_tables(breakdowns)]
    if note:
        lines += ["", note]
    storage.write_text(base + ".md", "\n".join(lines) + "\n")
    plot_tau_speedup(rows, base + ".png")
    return doc
