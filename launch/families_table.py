"""The equal-compute comparison of drafter families as a table and a figure.

    python -m launch.families_table --runs runs/families --methods eagle3,medusa,mlp_speculator,mtp,dflash \\
        --at_step eagle3=100 --mtbench docs/results/families_equal_mtbench.json \\
        --heldout docs/results/families_equal_heldout.json --out docs/results/families_equal

Reads each family's ``launch.train`` workdir under ``--runs`` (steps, rows, length; the wall time
and trainable parameters from ``<runs>/<method>.log``, as experiments/families_compare.sh writes it)
and two ``decode_bench`` results files (MT-Bench and held-out conversations, each with an AR row),
and writes ``<out>.json``, ``<out>.md`` and ``<out>.png``. What the columns mean:
``confu_jax.bench.families``.
"""

from __future__ import annotations

import json

from absl import app, flags

from confu_jax import storage
from confu_jax.bench import families
from confu_jax.bench.report import load_results

flags.DEFINE_string("runs", "runs/families", "folder of the families' launch.train workdirs and logs")
flags.DEFINE_list("methods", ["eagle3", "confu", "medusa", "mlp_speculator", "mtp", "dflash"],
                  "the families, in table order (decode_bench method names = workdir names)")
flags.DEFINE_list("branch", [], "METHOD=PARENT@STEP: runs started from a parent's checkpoint "
                  "(their steps and wall time include the parent's up to STEP)")
flags.DEFINE_list("at_step", [], "METHOD=STEP: a run's checkpoint at STEP instead of its last (the head "
                  "decode_bench measured for it; wall time prorated)")
flags.DEFINE_string("mtbench", None, "decode_bench results on MT-Bench", required=True)
flags.DEFINE_string("heldout", None, "decode_bench results on held-out conversations", required=True)
flags.DEFINE_string("reference", "eagle3", "the family τ ratios are taken against")
flags.DEFINE_string("out", "docs/results/families_equal", "output prefix (.json, .md, .png)")
FLAGS = flags.FLAGS


def _branches(specs) -> dict:
    out = {}
    for spec in specs:
        try:
            method, rest = spec.split("=")
            parent, step = rest.split("@")
            out[method] = (parent, int(step))
        except ValueError:
            raise app.UsageError(f"--branch: expected METHOD=PARENT@STEP (e.g. confu=eagle3@100); got {spec!r}")
    return out


def _at_steps(specs) -> dict:
    try:
        return {m: int(s) for m, s in (spec.split("=") for spec in specs)}
    except ValueError:
        raise app.UsageError(f"--at_step: expected METHOD=STEP entries (e.g. eagle3=100); got {specs!r}")


def main(argv):
    del argv
    branches, at_steps = _branches(FLAGS.branch), _at_steps(FLAGS.at_step)
    records = {}
    for method in sorted(FLAGS.methods, key=lambda m: m in branches):  # parents first
        records[method] = families.read_training(FLAGS.runs, method, branches.get(method), records,
                                                 at_step=at_steps.get(method))
    rows = families.comparison([records[m] for m in FLAGS.methods], load_results(FLAGS.mtbench),
                               load_results(FLAGS.heldout), reference=FLAGS.reference)
    table = families.markdown(rows, FLAGS.reference)
    storage.write_text(FLAGS.out + ".json", json.dumps(
        {"rows": rows, "mtbench": FLAGS.mtbench, "heldout": FLAGS.heldout, "runs": FLAGS.runs}, indent=1))
    storage.write_text(FLAGS.out + ".md", table)
    families.plot(rows, FLAGS.out + ".png")
    print(table)
    print(f"wrote {FLAGS.out}.json, .md, .png")


if __name__ == "__main__":
    from confu_jax.user_errors import cli_main

    app.run(cli_main("launch.families_table", main))
