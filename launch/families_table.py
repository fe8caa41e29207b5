"""The equal-compute comparison of drafter families as a table and a figure.

    python -m launch.families_table --runs runs/families --methods eagle3,medusa,mlp_speculator,mtp,dflash \\
        --at_step eagle3=100 --mtbench docs/results/families_equal_mtbench.json \\
        --heldout docs/results/families_equal_heldout.json --out docs/results/families_equal

Reads each family's ``launch.train`` workdir under ``--runs`` (steps, rows, length; the wall time
and trainable parameters from ``<runs>/<method>.log``, as experiments/families_compare.sh writes it)
and two ``decode_bench`` results files (MT-Bench and held-out conversations, each with an AR row),
and writes ``<out>.json``, ``<out>.md`` and ``<out>.png``. What the columns mean:
``confu_jax.bench.families``.

With ``--results SET=FILE[:METHOD=NAME,...]`` (repeated) in place of ``--mtbench`` / ``--heldout``: the grid
over prompt sets, temperatures and plans (``families.grid``: a line per set, T, family and plan, τ ratios
against the reference's line of the same plan kind), e.g. the drafters of 2026 with EAGLE 3.1 measured as
``eagle3`` in a run of its own::

    python -m launch.families_table --runs runs/families --methods eagle3,eagle31,dflash,peagle,dspark \\
        --results mtbench=docs/results/drafters2026_mtbench_eagle3.json \\
        --results mtbench=docs/results/drafters2026_mtbench_eagle31.json:eagle3=eagle31 \\
        --results mtbench=docs/results/drafters2026_mtbench_block.json \\
        --out docs/results/drafters2026

writes ``<out>.json`` and ``<out>.md`` (the training table, then the grid).
"""

from __future__ import annotations

import dataclasses
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
flags.DEFINE_string("training_from", None, "an earlier families_table JSON: the families named in its training "
                    "table take their record from it (the heads its results files measured), the rest from --runs")
flags.DEFINE_string("mtbench", None, "decode_bench results on MT-Bench")
flags.DEFINE_string("heldout", None, "decode_bench results on held-out conversations")
flags.DEFINE_multi_string("results", [], "SET=FILE[:METHOD=NAME,...]: decode_bench results measured on prompt set "
                          "SET, its methods renamed as given (repeat per file; several files per set); in place of "
                          "--mtbench / --heldout, the grid over sets, temperatures and plans")
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


def _result_sets(specs) -> dict:
    """``['mtbench=a.json', 'mtbench=b.json:eagle3=eagle31']`` -> {set: [(results, renaming), ...]}."""
    out: dict = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        path, _, renames = rest.partition(":")
        try:
            if not (sep and name and path):
                raise ValueError
            rename = dict(r.split("=") for r in renames.split(",")) if renames else {}
        except ValueError:
            raise app.UsageError(f"--results: expected SET=FILE[:METHOD=NAME,...] (e.g. "
                                 f"mtbench=b.json:eagle3=eagle31); got {spec!r}")
        out.setdefault(name, []).append((load_results(path), rename))
    return out


def main(argv):
    del argv
    if bool(FLAGS.results) == bool(FLAGS.mtbench or FLAGS.heldout) or (
            not FLAGS.results and not (FLAGS.mtbench and FLAGS.heldout)):
        raise app.UsageError("expected either --mtbench and --heldout, or --results SET=FILE (repeated); got "
                             f"--mtbench={FLAGS.mtbench!r} --heldout={FLAGS.heldout!r} --results={FLAGS.results}")
    branches, at_steps = _branches(FLAGS.branch), _at_steps(FLAGS.at_step)
    earlier = families.read_training_table(FLAGS.training_from) if FLAGS.training_from else {}
    records = {m: earlier[m] for m in FLAGS.methods if m in earlier}
    for method in sorted([m for m in FLAGS.methods if m not in records], key=lambda m: m in branches):  # parents first
        records[method] = families.read_training(FLAGS.runs, method, branches.get(method), records,
                                                 at_step=at_steps.get(method))
    if FLAGS.results:
        lines = families.grid([records[m] for m in FLAGS.methods], _result_sets(FLAGS.results),
                              reference=FLAGS.reference)
        table = (families.training_markdown([records[m] for m in FLAGS.methods]) + "\n"
                 + families.grid_markdown(lines, FLAGS.reference))
        storage.write_text(FLAGS.out + ".json", json.dumps(
            {"training": [dataclasses.asdict(records[m]) for m in FLAGS.methods], "grid": lines,
             "results": FLAGS.results, "runs": FLAGS.runs}, indent=1))
        storage.write_text(FLAGS.out + ".md", table)
        print(table)
        print(f"wrote {FLAGS.out}.json, .md")
        return
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
    from confu_jax.user_errors import run

    run("launch.families_table", main)
