"""Two benchmark rows compared by question, across ``decode_bench`` outputs (``launch.tau_compare``).

``decode_bench`` takes one draft source per method, so two drafters of one family (an SD² run and
the distilled drafter it is compared with, two checkpoints of one head) are measured in two
invocations; each row keeps its per-question counts (``questions``), so they pair without a rerun.
"""

from __future__ import annotations

import json


def find_row(path: str, method: str, temperature: float, budget: str = "") -> dict:
    """The row of ``method`` at ``temperature`` (and ``budget``) in a ``decode_bench`` results JSON."""
    with open(path) as f:
        rows = json.load(f)["results"]
    hits = [r for r in rows if r.get("method") == method and abs(float(r.get("temperature", 0.0)) - temperature) < 1e-9
            and (not budget or str(r.get("budget")) == budget)]
    if len(hits) != 1:
        have = sorted({(r.get("method"), float(r.get("temperature", 0.0)), str(r.get("budget"))) for r in rows})
        raise ValueError(f"{path}: expected one row of method {method!r} at T={temperature:g}"
                         f"{' budget ' + budget if budget else ''}; found {len(hits)} (rows: {have})")
    if "questions" not in hits[0]:
        raise ValueError(f"{path}: row {method!r} has no per-question counts ('questions'); rerun decode_bench "
                         "with --methods (speculative mode)")
    return hits[0]


def compare(row: dict, reference: dict, *, n_boot: int = 2000) -> dict:
    """τ, τ ratio and accepted-drafts ratio of ``row`` over ``reference`` with paired intervals."""
    from confu_jax.bench import intervals

    a, b = row["questions"], reference["questions"]
    common = [q for q in a if q in b]
    a, b = {q: a[q] for q in common}, {q: b[q] for q in common}
    return {
        "n_questions": len(common),
        "tau": {"row": sum(a[q]["emitted"] for q in a) / max(sum(a[q]["passes"] for q in a), 1),
                "reference": sum(b[q]["emitted"] for q in b) / max(sum(b[q]["passes"] for q in b), 1),
                "row_ci": intervals.tau_interval(a, n_boot=n_boot),
                "reference_ci": intervals.tau_interval(b, n_boot=n_boot)},
        "tau_ratio": intervals.tau_ratio(a, b, n_boot=n_boot),
        "accepted_ratio": intervals.accepted_ratio(a, b, n_boot=n_boot),
    }
