"""τ broken down by where in the answer a verification pass starts and by where the prompt came from.

Why: one pooled τ hides two things that move it. Acceptance is not uniform along an answer (an
opening sentence, boilerplate, code or a list each accept differently), so answers of different
lengths weight the positions differently; and prompt sources differ (held-out ShareGPT questions
like the training data, MT-Bench, HumanEval). The question: which explains held-out decode τ 1.63
against MT-Bench's 1.28 on the same heads.

Definitions (the logs are :class:`confu_jax.bench.metrics.GenerationLog`, one per generated turn):

* **Answer position of a pass** = the number of tokens of that turn's answer emitted before it,
  i.e. the index in the answer of the first token the pass emits. The prefill's first token is
  answer position 0 (``new_tokens − sum(accept_lengths)`` = 1 such token), so the first pass starts
  at position 1, and pass i at ``1 + a_0 + … + a_{i−1}``. Every turn restarts at 0 (an MT-Bench
  second turn is an answer of its own).
* **Bucket** ``[lo, hi)`` of pass start positions; the default edges (0, 16, 32, 64, 128) give
  [0,16), [16,32), [32,64), [64,128), [128,∞).
* **τ of a group of passes** = tokens they emitted / their number, pooled over passes (Spec-Bench's
  τ, :func:`confu_jax.bench.metrics.tau`), so the passes of every bucket together give the overall τ.
* **Prompt source** (:func:`prompt_source`): ``humaneval`` for HumanEval task ids, ``mtbench`` for
  MT-Bench's eight categories with integer ids, otherwise the question's category (``heldout`` for
  ``launch.heldout_questions`` files, a Spec-Bench category, ...).

The benchmark keeps each finished unit's logs in ``<out>.parts/<key>.json`` (``spec_bench.Parts``:
``{"row", "logs", "tokens"}``); :func:`load_units` reads them back, ``report.write_outputs`` adds
these tables to the benchmark's report, and ``python -m launch.tau_breakdown`` prints them for an
existing benchmark.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable, Mapping, Sequence

from confu_jax import storage
from confu_jax.bench.metrics import GenerationLog
from confu_jax.bench.prompts import MTBENCH_CATEGORIES

DEFAULT_EDGES = (0, 16, 32, 64, 128)


def pass_starts(log: GenerationLog) -> list[int]:
    """Answer position of each pass of one turn (module docstring): tokens of the turn emitted before it."""
    pos = log.new_tokens - sum(log.accept_lengths)  # 1 when the prefill emitted the first token
    out = []
    for a in log.accept_lengths:
        out.append(pos)
        pos += a
    return out


def _check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    edges = tuple(int(e) for e in edges)
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must start at 0 and increase strictly; got {list(edges)}")
    return edges


def bucket_label(lo: int, hi: int | None) -> str:
    return f"[{lo},{'∞' if hi is None else hi})"


def _cell(tokens: int, passes: int) -> dict:
    return {"tau": tokens / passes if passes else math.nan, "passes": passes, "tokens": tokens}


def by_position(logs: Iterable[GenerationLog], edges: Sequence[int] = DEFAULT_EDGES) -> list[dict]:
    """One dict per bucket [edges[i], edges[i+1]) (the last open-ended, ``hi`` None): ``lo``, ``hi``,
    ``tau`` (pooled; nan for a bucket no pass starts in), ``passes``, ``tokens``."""
    edges = _check_edges(edges)
    tokens = [0] * len(edges)
    passes = [0] * len(edges)
    for g in logs:
        for start, a in zip(pass_starts(g), g.accept_lengths):
            k = sum(1 for e in edges[1:] if start >= e)
            tokens[k] += a
            passes[k] += 1
    his = list(edges[1:]) + [None]
    return [{"lo": lo, "hi": hi, **_cell(t, p)} for lo, hi, t, p in zip(edges, his, tokens, passes)]


def prompt_source(question_id, category: str) -> str:
    """Which benchmark a question came from (module docstring)."""
    if isinstance(question_id, str) and question_id.startswith("HumanEval/"):
        return "humaneval"
    if category in MTBENCH_CATEGORIES and isinstance(question_id, int) and not isinstance(question_id, bool):
        return "mtbench"
    return category


def _group(logs: Sequence[GenerationLog], key: Callable[[GenerationLog], str], edges) -> dict:
    names = list(dict.fromkeys(key(g) for g in logs))
    out = {}
    for name in names:
        sel = [g for g in logs if key(g) == name]
        tokens = sum(sum(g.accept_lengths) for g in sel)
        passes = sum(len(g.accept_lengths) for g in sel)
        out[name] = {**_cell(tokens, passes), "questions": len({g.question_id for g in sel}), "turns": len(sel),
                     "by_position": by_position(sel, edges)}
    return out


def tau_breakdown(logs: Sequence[GenerationLog], edges: Sequence[int] = DEFAULT_EDGES,
                  source_of: Callable = prompt_source) -> dict:
    """τ of ``logs`` overall, per answer-position bucket, and per prompt source and per category
    (each with its own buckets): ``{"tau", "passes", "tokens", "questions", "turns", "by_position":
    [...], "by_source": {name: {...}}, "by_category": {name: {...}}}`` (names in order of appearance)."""
    logs = list(logs)
    edges = _check_edges(edges)
    tokens = sum(sum(g.accept_lengths) for g in logs)
    passes = sum(len(g.accept_lengths) for g in logs)
    return {**_cell(tokens, passes), "questions": len({g.question_id for g in logs}), "turns": len(logs),
            "edges": list(edges), "by_position": by_position(logs, edges),
            "by_source": _group(logs, lambda g: source_of(g.question_id, g.category), edges),
            "by_category": _group(logs, lambda g: g.category, edges)}


# ----------------------------------------------------------------------------- benchmark units


def _same_unit(a: Mapping, b: Mapping) -> bool:
    return (a.get("method") == b.get("method") and a.get("budget") == b.get("budget")
            and float(a.get("temperature", math.nan)) == float(b.get("temperature", math.nan)))


def load_units(parts_dir: str, rows: Sequence[Mapping] | None = None) -> list[tuple[dict, list[GenerationLog]]]:
    """(row, logs) of every unit ``spec_bench.Parts`` saved in ``parts_dir`` (``<key>.json`` with
    ``row`` and ``logs``; ``settings.json`` is not a unit). With ``rows`` (a benchmark's results), only
    the units of those rows, in their order: a parts folder may also hold units of earlier invocations
    with other methods or budgets, which the report did not include."""
    units = []
    for name in sorted(storage.listdir(parts_dir)):
        if not name.endswith(".json") or name == "settings.json":
            continue
        path = os.path.join(parts_dir, name)
        try:
            obj = json.loads(storage.read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a benchmark unit (invalid JSON: {e.msg})") from None
        if not isinstance(obj, dict) or "row" not in obj or "logs" not in obj:
            raise ValueError(f"{path}: not a benchmark unit (expected keys 'row' and 'logs', found "
                             f"{sorted(obj) if isinstance(obj, dict) else type(obj).__name__})")
        units.append((obj["row"], [GenerationLog.from_json(g) for g in obj["logs"]]))
    if rows is None:
        return units
    picked = []
    for r in rows:
        match = [u for u in units if _same_unit(u[0], r)]
        if match:
            picked.append(match[0])
    return picked


# ----------------------------------------------------------------------------- tables


def _fmt_cell(c: Mapping, digits: int) -> str:
    return "–" if not c["passes"] else f"{c['tau']:.{digits}f} ({c['passes']})"


def _row_label(row: Mapping) -> list[str]:
    return [str(row.get("method")), f"{float(row.get('temperature', 0.0)):g}", str(row.get("budget") or "–")]


def breakdown_rows(units: Sequence[tuple[Mapping, Sequence[GenerationLog]]], edges: Sequence[int] = DEFAULT_EDGES,
                   skip_ar: bool = True) -> list[dict]:
    """JSON of every unit's breakdown: ``{"method", "temperature", "budget", **tau_breakdown}``. AR
    units (τ = 1 everywhere) are left out unless ``skip_ar`` is False."""
    out = []
    for row, logs in units:
        if skip_ar and row.get("method") == "ar":
            continue
        out.append({"method": row.get("method"), "temperature": row.get("temperature"),
                    "budget": row.get("budget"), **tau_breakdown(logs, edges)})
    return out


def markdown_tables(breakdowns: Sequence[Mapping], digits: int = 2) -> str:
    """Two tables: τ (passes) per answer-position bucket, one line per (row, prompt source) plus the
    row's total; and τ per prompt source with its questions, turns and passes."""
    if not breakdowns:
        return ""
    edges = breakdowns[0]["edges"]
    labels = [bucket_label(c["lo"], c["hi"]) for c in breakdowns[0]["by_position"]]
    head = ["Method", "T", "Budget", "Source"] + labels + ["all"]
    lines = ["τ (passes) by the answer position where a pass starts (tokens of the turn emitted before it):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for b in breakdowns:
        if list(b["edges"]) != list(edges):
            raise ValueError(f"markdown_tables: rows bucketed differently ({b['edges']} vs {edges})")
        groups = list(b["by_source"].items()) + ([("all", b)] if len(b["by_source"]) > 1 else [])
        for name, g in groups:
            cells = [_fmt_cell(c, digits) for c in g["by_position"]] + [_fmt_cell(g, digits)]
            lines.append("| " + " | ".join(_row_label(b) + [name] + cells) + " |")
    lines += ["", "τ by prompt source:", "", "| Method | T | Budget | Source | questions | turns | passes | τ |",
              "|---|---|---|---|---|---|---|---|"]
    for b in breakdowns:
        for name, g in list(b["by_source"].items()) + [("all", b)]:
            tau = "–" if not g["passes"] else f"{g['tau']:.{digits}f}"
            lines.append("| " + " | ".join(_row_label(b) + [name, str(g["questions"]), str(g["turns"]),
                                                           str(g["passes"]), tau]) + " |")
    return "\n".join(lines) + "\n"
