"""Held-out τ against tokens seen, and what a τ goal would cost: ``python -m launch.scaling_curve``.

    # 1. train with milestones (checkpoints kept and evaluated at those steps), e.g.
    #    --config.train.milestones=4,8,16,32,64 (experiments/scaling_curve.sh does this for EAGLE-3 and ConFu)
    # 2. decode held-out questions with every milestone's head; add the training evaluation's chain τ
    python -m launch.scaling_curve measure --runs eagle3=runs/scaling/eagle3,confu=runs/scaling/confu \\
        --prompts runs/scaling/heldout.jsonl --budgets chain:3,dynamic:6,10,60 --out docs/results/scaling_points.json
    # 3. fit τ = a + b·log10(tokens) per method and measurement; the tokens τ 2 / 2.5 / 3 would take
    python -m launch.scaling_curve fit --points docs/results/scaling_points.json \\
        --tokens_per_s eagle3=380,confu=350 --out docs/results/scaling

``measure`` loads the target once; per budget each run's milestones share one compiled program
(``bench.spec_bench.checkpoint_rows``), so a point costs its decoding, not a compile. Every decoded
point is checked lossless against AR. ``fit`` writes ``<out>.md`` (points, fits, goals), ``<out>.json``
and ``<out>.png``. What the fit means and where it stops meaning anything: ``confu_jax.bench.scaling``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags

from confu_jax import storage
from confu_jax.bench import scaling

flags.DEFINE_list("runs", [], "measure: METHOD=WORKDIR pairs (launch.train workdirs of eagle3 / confu heads)")
flags.DEFINE_string("prompts", "", "measure: question file of held-out conversations (launch.heldout_questions)")
flags.DEFINE_string("budgets", "chain:3,dynamic:6,10,60", "measure: decode budgets (plans); '' = none")
flags.DEFINE_list("steps", [], "measure: checkpoint steps (default: every step a run kept; with --budgets '': "
                  "every step of its eval.csv)")
flags.DEFINE_list("eval_depths", ["3"], "measure: training-evaluation chain depths read from eval.csv "
                  "(decode_tau/chain{D} at the same steps)")
flags.DEFINE_enum("tokens", "rows", ["rows", "positions"], "measure: the x axis — 'rows': tokens of the "
                  "training batches (rows x length x steps, the same for every head trained on the same batches); "
                  "'positions': trained answer positions (ConFu trains sampled windows, so fewer than EAGLE-3)")
flags.DEFINE_integer("max_new_tokens", 128, "measure: tokens decoded per question")
flags.DEFINE_string("model", "smollm2-135m-instruct", "measure: the target the heads were trained on")
flags.DEFINE_list("points", [], "fit: points files written by measure")
flags.DEFINE_list("tokens_per_s", [], "fit: METHOD=RATE training tokens (seen) per second, to state goals in hours")
flags.DEFINE_list("goals", ["2", "2.5", "3"], "fit: τ goals")
flags.DEFINE_float("min_tokens", 0.0, "fit: leave out points below this many tokens seen (the warm-up's, "
                   "where τ still climbs from the untrained head's ~1); they stay in the table and figure")
flags.DEFINE_string("out", None, "measure: points .json; fit: output stem (.md, .json, .png)", required=True)
FLAGS = flags.FLAGS


def _pairs(items, what: str) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise app.UsageError(f"--{what}: {item!r} is not NAME=VALUE")
        out[key] = value
    return out


def _eval_steps(workdir: str) -> list:
    from confu_jax.train.metric_writers import read_csv

    path = os.path.join(workdir, "eval.csv")
    return sorted(int(r["step"]) for r in read_csv(path)) if storage.isfile(path) else []


def _eval_points(method: str, workdir: str, steps, depths, tokens_at) -> list:
    from confu_jax.train.metric_writers import read_csv

    path = os.path.join(workdir, "eval.csv")
    if not storage.isfile(path):
        return []
    rows = {int(r["step"]): r for r in read_csv(path)}
    out = []
    for step in steps:
        for d in depths:
            v = rows.get(step, {}).get(f"decode_tau/chain{d}")
            if v is not None:
                out.append(scaling.Point(method=method, series=f"chain:{d} (training eval)", step=step,
                                         tokens=tokens_at(step), tau=float(v)))
    return out


def measure() -> None:
    from tqdm import tqdm

    from confu_jax.bench import cli_args, spec_bench
    from confu_jax.bench.prompts import load_prompts
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.runs.checkpoint import Checkpointer
    from confu_jax.runs.lineage import lineage
    from confu_jax.weights import load_model

    runs = _pairs(FLAGS.runs, "runs")
    if not runs:
        raise app.UsageError("measure needs --runs METHOD=WORKDIR[,...]")
    budgets = cli_args.parse_budgets(FLAGS.budgets) if FLAGS.budgets else []
    depths = [int(d) for d in FLAGS.eval_depths]
    points, rows_out = [], {}
    setup, prompts = None, None
    for method, workdir in runs.items():
        if not budgets:  # the training evaluation alone: every step of eval.csv (also a run that came
            kept = _eval_steps(workdir)  # back without its checkpoints, as the GPU campaign's do)
        elif storage.isdir(os.path.join(workdir, "checkpoints")):
            ck = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
            kept = ck.all_steps()
            ck.close()
        else:
            raise app.UsageError(f"{workdir} has no checkpoints/ to decode; --budgets '' reads eval.csv alone")
        steps = [int(s) for s in FLAGS.steps] or kept
        missing = sorted(set(steps) - set(kept))
        if missing:
            what = "evaluated (eval.csv)" if not budgets else "kept checkpoints"
            raise app.UsageError(f"{workdir} {what} at steps {kept}; --steps asks for {missing} too")

        key = "row_tokens" if FLAGS.tokens == "rows" else "tokens_seen"

        def tokens_at(step, workdir=workdir):  # a released ancestor records trained positions only
            return float(sum(c.get(key) or c.get("tokens_seen") or 0 for c in lineage(workdir, step)))

        points += _eval_points(method, workdir, steps, depths, tokens_at)
        if not budgets:
            continue
        if setup is None:
            if not FLAGS.prompts:
                raise app.UsageError("decoding (--budgets) needs --prompts (launch.heldout_questions)")
            prompts = load_prompts(FLAGS.prompts)
            cfg, params = load_model(FLAGS.model)
            setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(FLAGS.model),
                                          max_new_tokens=FLAGS.max_new_tokens)
            print(f"{FLAGS.model}: {len(prompts)} questions from {FLAGS.prompts}, {FLAGS.max_new_tokens} tokens",
                  flush=True)
        rows = spec_bench.checkpoint_rows(
            setup, prompts, method=method, sources=[(f"step {s}", f"{workdir}@{s}") for s in steps],
            budgets=budgets, log=lambda m: print(m, flush=True),
            progress_factory=lambda **kw: tqdm(leave=False, dynamic_ncols=True, **kw))
        rows_out[method] = [{k: r.get(k) for k in ("label", "budget", "tau", "tau_ci", "speedup", "tokens_per_s",
                                                   "lossless_greedy", "head")} for r in rows]
        for r in rows[1:]:
            step = int(r["label"].split()[-1])
            lo, hi = r["tau_ci"]
            points.append(scaling.Point(method=method, series=r["budget"], step=step, tokens=tokens_at(step),
                                        tau=float(r["tau"]), tau_lo=float(lo), tau_hi=float(hi),
                                        lossless=bool(r["lossless_greedy"])))
    storage.write_text(FLAGS.out, json.dumps(
        {"runs": runs, "tokens": FLAGS.tokens, "prompts": FLAGS.prompts, "max_new_tokens": FLAGS.max_new_tokens,
         "budgets": budgets, "points": [dataclasses.asdict(p) for p in points], "rows": rows_out}, indent=1))
    print(f"wrote {FLAGS.out}: {len(points)} points")


def fit() -> None:
    points = []
    for path in FLAGS.points:
        points += [scaling.Point(**p) for p in json.loads(storage.read_text(path))["points"]]
    if not points:
        raise app.UsageError("fit needs --points FILE[,...] with points (launch.scaling_curve measure)")
    rates = {m: float(v) for m, v in _pairs(FLAGS.tokens_per_s, "tokens_per_s").items()}
    goals = [float(g) for g in FLAGS.goals]
    md, fits = scaling.table(points, goals, rates, min_tokens=FLAGS.min_tokens)
    storage.write_text(FLAGS.out + ".md", md)
    storage.write_text(FLAGS.out + ".json", json.dumps(
        {"points": [dataclasses.asdict(p) for p in points], "fits": fits, "tokens_per_s": rates}, indent=1,
        default=str))
    scaling.figure(points, FLAGS.out + ".png", goals, min_tokens=FLAGS.min_tokens)
    print(md)
    print(f"wrote {FLAGS.out}.md, .json, .png")


def main(argv):
    if len(argv) != 2 or argv[1] not in ("measure", "fit"):
        raise app.UsageError("usage: python -m launch.scaling_curve measure|fit --out ... (see the docstring)")
    measure() if argv[1] == "measure" else fit()


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.scaling_curve", main)
