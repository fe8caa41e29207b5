"""Drafter families compared at equal training compute: one table from their training runs and
two ``decode_bench`` results files (``launch.families_table``: the families at equal training compute).

Why a table of its own: ``decode_bench`` measures decoding, the training directories hold what each
head cost to train; a user choosing a drafter needs both on one line — tokens seen and wall time,
τ on held-out conversations (the training distribution) and on MT-Bench (a shift), τ against
EAGLE-3's paired by question, the speed-up over AR and the cost of one verification pass.

What "equal compute" means here: every family read the same batches (same data files, seed, rows
and length, padded rows so no family packs more tokens into a row) for the same number of optimizer
steps. A branched run (ConFu from EAGLE-3's step E, the paper's protocol) counts the steps and wall
time of its parent up to the branch point, so its total equals the others'.

Pass cost: one verification pass of the method (draft + verify + accept) in AR steps, from the same
run's wall times: ``(wall / passes) / (wall_AR / passes_AR)``. Speed-up ≈ τ / pass cost, so the two
columns say whether a family loses on acceptance or on cost.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Mapping, Optional, Sequence

from confu_jax import storage
from confu_jax.bench.compare import compare

_WALL_RE = re.compile(r"^(\S+) wall ([0-9.]+) s$", re.M)  # what `/usr/bin/time -f "<name> wall %e s"` appends
_PARAMS_RE = re.compile(r"trainable ([0-9,]+) params")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingRecord:
    """What one family's head cost to train.

    Attributes:
      method: the decode_bench method name (eagle3, confu, medusa, ...).
      steps: optimizer steps, the parent's up to the branch point included.
      rows, length: batch rows and tokens per (padded) row.
      wall_s: training wall time in seconds (the parent's share included), None when unknown.
      trainable_params: the head's trainable parameters (None when the log does not say).
      parent: the run this one branched from and the branch step, or None.
    """

    method: str
    steps: int
    rows: int
    length: int
    wall_s: Optional[float]
    trainable_params: Optional[int]
    parent: Optional[tuple[str, int]] = None

    @property
    def row_tokens(self) -> int:
        """Tokens of the batches the head was trained on (padding included): equal across families."""
        return self.steps * self.rows * self.length


def _last_checkpoint(workdir: str) -> int:
    ck = os.path.join(workdir, "checkpoints")
    steps = [int(d) for d in os.listdir(ck) if d.isdigit()] if os.path.isdir(ck) else []
    if not steps:
        raise FileNotFoundError(f"{workdir}: expected finished checkpoints under checkpoints/<step>; found none")
    return max(steps)


def read_training_table(path: str) -> dict[str, TrainingRecord]:
    """{method: TrainingRecord} from an earlier ``launch.families_table --results`` output (its ``training``
    list): the records of heads whose results files come from that run, when their workdirs are gone (a
    later comparison tables new families beside them, paired by question on the same prompts and seed)."""
    with storage.open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict) or not isinstance(table.get("training"), list):
        raise ValueError(f"{path}: expected a launch.families_table JSON with a 'training' list; got "
                         f"{sorted(table) if isinstance(table, dict) else type(table).__name__}")
    out = {}
    for r in table["training"]:
        parent = tuple(r["parent"]) if r.get("parent") else None
        out[r["method"]] = TrainingRecord(method=r["method"], steps=int(r["steps"]), rows=int(r["rows"]),
                                          length=int(r["length"]), wall_s=r.get("wall_s"),
                                          trainable_params=r.get("trainable_params"), parent=parent)
    return out


def read_training(runs_dir: str, method: str, parent: Optional[tuple[str, int]] = None,
                  records: Optional[Mapping[str, TrainingRecord]] = None,
                  at_step: Optional[int] = None) -> TrainingRecord:
    """The ``TrainingRecord`` of ``runs_dir/method`` (a ``launch.train`` workdir) and its log
    ``runs_dir/method.log`` (the wall-time line ``<method> wall <s> s`` that
    experiments/families_compare.sh appends, and the loop's ``trainable N params``).

    ``parent=(name, step)``: the run branched from ``name``'s checkpoint ``step``; its record (in
    ``records``) contributes ``step`` steps and that share of its wall time. ``at_step``: the run's
    checkpoint at that step rather than its last (the wall time prorated: steps cost alike).
    """
    workdir = os.path.join(runs_dir, method)
    if not os.path.exists(os.path.join(workdir, "config.json")):
        raise FileNotFoundError(f"{workdir}: expected a launch.train workdir (config.json, checkpoints/<step>)")
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = json.load(f)
    rows, length = int(cfg["data"]["global_batch_size"]), int(cfg["data"]["max_length"])
    if cfg["data"].get("pack"):
        raise ValueError(f"{workdir}: packed rows (data.pack=True) hold more tokens per row than padded ones; "
                         "the equal-compute table expects every family on padded rows")
    last = steps = _last_checkpoint(workdir)
    if at_step is not None:
        if not os.path.isdir(os.path.join(workdir, "checkpoints", str(at_step))):
            raise FileNotFoundError(f"{workdir}: expected a checkpoint at step {at_step} (checkpoints/{at_step})")
        steps = int(at_step)
    wall = params = None
    log = os.path.join(runs_dir, f"{method}.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            text = f.read()
        walls = [float(s) for name, s in _WALL_RE.findall(text) if name == method]
        wall = sum(walls) * steps / last if walls else None
        m = _PARAMS_RE.search(text)
        params = int(m.group(1).replace(",", "")) if m else None
    if parent is not None:
        if at_step is not None:
            raise ValueError(f"{method}: at_step and parent together are not supported")
        name, at = parent
        if records is None or name not in records:
            raise ValueError(f"{method}: branched from {name!r}, whose training record is not given")
        p = records[name]
        if (p.rows, p.length) != (rows, length):
            raise ValueError(f"{method}: rows x length {rows} x {length} differ from its parent {name}'s "
                             f"{p.rows} x {p.length}")
        wall = None if wall is None or p.wall_s is None else wall + p.wall_s * at / p.steps
        steps += at
    return TrainingRecord(method=method, steps=steps, rows=rows, length=length, wall_s=wall,
                          trainable_params=params, parent=parent)


def _row(results: Sequence[Mapping], method: str) -> Optional[dict]:
    hits = [r for r in results if r.get("method") == method]
    return dict(hits[0]) if hits else None


def pass_cost(row: Mapping, ar: Mapping) -> float:
    """Seconds per verification pass of ``row`` over seconds per AR step, both from one run."""
    return (row["wall_s"] / row["n_target_passes"]) / (ar["wall_s"] / ar["n_target_passes"])


def _measured(row: Mapping, ar: Mapping) -> dict:
    """What a table line shows of one decode_bench row: τ, speed-up, pass cost against ``ar`` (same run)."""
    return {"budget": row.get("budget"), "tau": row["tau"], "tau_ci": row.get("tau_ci"), "speedup": row["speedup"],
            "speedup_ci": row.get("speedup_ci"), "pass_cost": pass_cost(row, ar),
            "acceptance_per_depth": row.get("acceptance_rate_per_depth"), "lossless": row.get("lossless_greedy"),
            "n_questions": row["n_questions"]}


def comparison(records: Sequence[TrainingRecord], mtbench: Sequence[Mapping], heldout: Sequence[Mapping],
               reference: str = "eagle3", n_boot: int = 2000) -> list[dict]:
    """One row per family: training cost, held-out and MT-Bench τ, τ over ``reference``'s (paired
    by question, MT-Bench and held-out), speed-up and pass cost on MT-Bench, losslessness.

    Raises when the families did not see the same row tokens (the table's premise) or a benchmark
    lacks AR or a family.
    """
    tokens = {r.method: r.row_tokens for r in records}
    if len(set(tokens.values())) != 1:
        raise ValueError(f"families trained on different token budgets (rows x length x steps): {tokens}")
    out = []
    for bench_name, results in (("mtbench", mtbench), ("heldout", heldout)):
        if _row(results, "ar") is None:
            raise ValueError(f"{bench_name} results: expected an 'ar' row (the speed-up's baseline)")
    ref = {b: _row(res, reference) for b, res in (("mtbench", mtbench), ("heldout", heldout))}
    for rec in records:
        line = {"method": rec.method, "steps": rec.steps, "row_tokens": rec.row_tokens, "wall_s": rec.wall_s,
                "trainable_params": rec.trainable_params,
                "branched_from": f"{rec.parent[0]}@{rec.parent[1]}" if rec.parent else None}
        for b, results in (("mtbench", mtbench), ("heldout", heldout)):
            row, ar = _row(results, rec.method), _row(results, "ar")
            if row is None:
                raise ValueError(f"{b} results: no row for method {rec.method!r}; "
                                 f"have {sorted({r.get('method') for r in results})}")
            line[b] = _measured(row, ar)
            if ref[b] is not None and rec.method != reference:
                c = compare(row, ref[b], n_boot=n_boot)
                line[b]["tau_ratio"] = c["tau_ratio"]["ratio"]
                line[b]["tau_ratio_ci"] = c["tau_ratio"]["ci"]
        out.append(line)
    return out


def plan_kind(budget: str) -> str:
    """``chain`` for a chain plan (``chain:K``, ``chain:K@P``, ``sampled_chain:K``), else ``tree``: rows of
    one kind are compared with each other (EAGLE-3's best-first tree against DDTree's, same node budget)."""
    return "chain" if str(budget).split(":")[0] in ("chain", "sampled_chain") else "tree"


def grid(records: Sequence[TrainingRecord], sets: Mapping[str, Sequence[tuple[Sequence[Mapping], Mapping[str, str]]]],
         reference: str = "eagle3", n_boot: int = 2000) -> list[dict]:
    """The families over several prompt sets, temperatures and plans: one line per (set, T, family, plan).

    ``sets``: set name -> the ``decode_bench`` results measured on it, each with a renaming of its methods
    (``{"eagle3": "eagle31"}``: a second EAGLE-3 head measured in a run of its own). A line's pass cost
    and speed-up are against the AR row of its own results (same run, same temperature); its τ ratio is
    paired by question with ``reference``'s line of the same set, temperature and plan kind (runs of one
    set sample the same questions). Raises when the families saw different row tokens, a results list
    has no AR row at a temperature it measured, or a family has no row in a set.
    """
    tokens = {r.method: r.row_tokens for r in records}
    if len(set(tokens.values())) != 1:
        raise ValueError(f"families trained on different token budgets (rows x length x steps): {tokens}")
    wanted = [r.method for r in records]
    out = []
    for set_name, runs in sets.items():
        lines = []
        for results, rename in runs:
            ars = {float(r["temperature"]): r for r in results if r.get("method") == "ar"}
            for r in results:
                method = rename.get(r.get("method"), r.get("method"))
                if method not in wanted:
                    continue
                t = float(r["temperature"])
                if t not in ars:
                    raise ValueError(f"{set_name} results: expected an 'ar' row at T={t:g} (the speed-up's "
                                     f"baseline); have {sorted(ars)}")
                lines.append({"set": set_name, "method": method, "temperature": t,
                              "kind": plan_kind(r.get("budget")), **_measured(r, ars[t]), "_row": r})
        missing = sorted(set(wanted) - {ln["method"] for ln in lines})
        if missing:
            raise ValueError(f"{set_name} results: no row for {missing}; have {sorted({ln['method'] for ln in lines})}")
        refs = {(ln["temperature"], ln["kind"]): ln["_row"] for ln in lines if ln["method"] == reference}
        for ln in lines:
            ref = refs.get((ln["temperature"], ln["kind"]))
            if ref is not None and ln["method"] != reference:
                c = compare(ln["_row"], ref, n_boot=n_boot)
                ln["tau_ratio"], ln["tau_ratio_ci"] = c["tau_ratio"]["ratio"], c["tau_ratio"]["ci"]
        order = {m: i for i, m in enumerate(wanted)}
        lines.sort(key=lambda ln: (ln["temperature"], order[ln["method"]], ln["kind"] != "chain"))
        out += [{k: v for k, v in ln.items() if k != "_row"} for ln in lines]
    return out


def training_markdown(records: Sequence[TrainingRecord]) -> str:
    """What each family's head cost to train, one line each."""
    lines = ["| family | trainable params | steps (row tokens) | train wall |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r.method} | " + (f"{r.trainable_params / 1e6:.1f} M" if r.trainable_params else "–")
                     + f" | {r.steps} ({r.row_tokens / 1e3:.0f}k) | "
                     + (f"{r.wall_s / 60:.1f} min" if r.wall_s else "–") + " |")
    return "\n".join(lines) + "\n"


def grid_markdown(lines: Sequence[Mapping], reference: str = "eagle3") -> str:
    """The grid as one markdown table: a line per (set, T, family, plan)."""
    head = ["set", "T", "family", "plan", "τ", f"τ / {reference}", "speed-up", "pass cost (AR steps)",
            "accepted at depth 1/2/3", "lossless (T = 0)"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for ln in lines:
        acc = ln.get("acceptance_per_depth") or []
        out.append("| " + " | ".join([
            ln["set"], f"{ln['temperature']:g}", ln["method"], str(ln["budget"]), _ci(ln["tau"], ln.get("tau_ci")),
            "1" if ln["method"] == reference else _ci(ln.get("tau_ratio"), ln.get("tau_ratio_ci"), 3),
            _ci(ln["speedup"], ln.get("speedup_ci")), f"{ln['pass_cost']:.2f}",
            " / ".join("–" if a is None else f"{a:.2f}" for a in acc[:3]) if acc else "–",
            {True: "yes", False: "no"}.get(ln.get("lossless"), "–")]) + " |")
    return "\n".join(out) + "\n"


def _ci(value, ci, digits: int = 2) -> str:
    if value is None:
        return "–"
    if not ci or ci[0] is None or (isinstance(ci[0], float) and math.isnan(ci[0])):
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def markdown(rows: Sequence[Mapping], reference: str = "eagle3") -> str:
    """The comparison as a markdown table (one line per family)."""
    head = ["family", "trainable params", "steps (row tokens)", "train wall", "held-out τ",
            f"held-out τ / {reference}", "MT-Bench τ", f"MT-Bench τ / {reference}", "MT-Bench speed-up",
            "pass cost (AR steps)", "accepted at depth 1/2/3", "lossless"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        m, h = r["mtbench"], r["heldout"]
        acc = m.get("acceptance_per_depth") or []
        cells = [
            r["method"] + (f" (from {r['branched_from']})" if r.get("branched_from") else ""),
            f"{r['trainable_params'] / 1e6:.1f} M" if r.get("trainable_params") else "–",
            f"{r['steps']} ({r['row_tokens'] / 1e3:.0f}k)",
            f"{r['wall_s'] / 60:.1f} min" if r.get("wall_s") else "–",
            _ci(h["tau"], h.get("tau_ci")),
            _ci(h.get("tau_ratio"), h.get("tau_ratio_ci"), 3) if r["method"] != reference else "1",
            _ci(m["tau"], m.get("tau_ci")),
            _ci(m.get("tau_ratio"), m.get("tau_ratio_ci"), 3) if r["method"] != reference else "1",
            _ci(m["speedup"], m.get("speedup_ci")),
            f"{m['pass_cost']:.2f}",
            " / ".join(f"{a:.2f}" for a in acc[:3]) if acc else "–",
            "yes" if m.get("lossless") and h.get("lossless") else "no" if m.get("lossless") is False
            or h.get("lossless") is False else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Mapping], png_path: str) -> None:
    """τ on both prompt sets and the MT-Bench speed-up per family, with 95% intervals."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r["method"] for r in rows]
    fig = Figure(figsize=(max(7.0, 1.3 * len(rows) + 2), 4.2))
    FigureCanvasAgg(fig)
    ax_tau, ax_speed = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1.2]})

    def bars(ax, values, cis, offset, width, label):
        lo = [max(v - c[0], 0) if c and not math.isnan(c[0]) else 0 for v, c in zip(values, cis)]
        hi = [max(c[1] - v, 0) if c and not math.isnan(c[1]) else 0 for v, c in zip(values, cis)]
        ax.bar([i + offset for i in range(len(values))], values, width, yerr=[lo, hi], capsize=3, label=label)

    for k, (b, label) in enumerate((("heldout", "held-out conversations"), ("mtbench", "MT-Bench"))):
        bars(ax_tau, [r[b]["tau"] for r in rows], [r[b].get("tau_ci") for r in rows], -0.2 + 0.4 * k, 0.4, label)
    ax_tau.set_ylim(bottom=1.0)
    ax_tau.set_ylabel("τ (tokens per verification pass)")
    ax_tau.legend(fontsize=8)
    bars(ax_speed, [r["mtbench"]["speedup"] for r in rows], [r["mtbench"].get("speedup_ci") for r in rows],
         0.0, 0.6, "MT-Bench")
    ax_speed.axhline(1.0, color="k", lw=0.8, ls="--")
    ax_speed.set_ylabel("speed-up over AR (MT-Bench)")
    for ax in (ax_tau, ax_speed):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    budget = rows[0]["mtbench"].get("budget") if rows else None
    fig.suptitle(f"Drafter families at equal training compute ({budget or ''}, greedy)", fontsize=10)
    fig.tight_layout()
    storage.write_figure(png_path, fig, dpi=120)  # a local file or gs://
