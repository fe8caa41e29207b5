"""τ of one benchmark row against another, paired by question, across ``decode_bench`` outputs.

    python -m launch.tau_compare --row results/sd2.json:sd2 --reference results/distill.json:draft_model \\
        [--temperature 0] [--budget chain:4] [--json_out results/sd2_vs_distill.json]

Why: ``decode_bench`` takes one draft source per method, so two drafters of the same family (an SD²
run and the distilled drafter it is compared with, two checkpoints of one head) are measured in two
invocations. Each row keeps its per-question counts (``questions``), so the comparison needs no
rerun: τ of both with their intervals, the τ ratio, and the ratio of *accepted drafts* per pass
(τ − 1, the bonus token left out: the SD² paper's "+22% accepted tokens"), each with a percentile
bootstrap interval that resamples questions jointly for both rows (``bench.intervals``), so a
question that is easy for both does not widen it. Only questions both rows ran are paired.
"""

from __future__ import annotations

import json

from absl import app, flags

from confu_jax import storage
from confu_jax.bench.compare import compare, find_row

flags.DEFINE_string("row", None, "RESULTS_JSON:METHOD — the row measured (e.g. results/sd2.json:sd2)")
flags.DEFINE_string("reference", None, "RESULTS_JSON:METHOD — the row it is compared with")
flags.DEFINE_float("temperature", 0.0, "the rows' sampling temperature")
flags.DEFINE_string("budget", "", "the rows' budget / plan (e.g. chain:4); empty = the only row that matches")
flags.DEFINE_integer("n_boot", 2000, "bootstrap resamples")
flags.DEFINE_string("json_out", "", "also write the comparison here")
FLAGS = flags.FLAGS


def _spec(text: str, name: str):
    path, sep, method = text.rpartition(":")
    if not sep or not path or not method:
        raise app.UsageError(f"--{name} must be RESULTS_JSON:METHOD, got {text!r}")
    return path, method


def main(argv):
    del argv
    if not (FLAGS.row and FLAGS.reference):
        raise app.UsageError("--row and --reference are required")
    (pa, ma), (pb, mb) = _spec(FLAGS.row, "row"), _spec(FLAGS.reference, "reference")
    out = compare(find_row(pa, ma, FLAGS.temperature, FLAGS.budget),
                  find_row(pb, mb, FLAGS.temperature, FLAGS.budget), n_boot=FLAGS.n_boot)
    out.update(row=FLAGS.row, reference=FLAGS.reference, temperature=FLAGS.temperature, budget=FLAGS.budget)
    t, r, acc = out["tau"], out["tau_ratio"], out["accepted_ratio"]
    print(f"{ma} τ {t['row']:.3f} [{t['row_ci'][0]:.3f}, {t['row_ci'][1]:.3f}]  vs  {mb} τ {t['reference']:.3f} "
          f"[{t['reference_ci'][0]:.3f}, {t['reference_ci'][1]:.3f}]  ({out['n_questions']} questions, "
          f"T={FLAGS.temperature:g})")
    print(f"τ ratio {r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]; accepted drafts per pass (τ − 1) "
          f"ratio {acc['ratio']:.3f} [{acc['ci'][0]:.3f}, {acc['ci'][1]:.3f}]")
    if FLAGS.json_out:
        storage.write_text(FLAGS.json_out, json.dumps(out, indent=1))


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.tau_compare", main)
