"""τ by answer position and by prompt source from a finished decode benchmark's per-pass logs.

    python -m launch.tau_breakdown docs/results/bench.json          # its units in bench.parts/
    python -m launch.tau_breakdown docs/results/bench.parts --edges 0,32,128 --json breakdown.json

The argument is a ``launch.decode_bench`` results file (the units of its rows are read from
``<results>.parts/``, which ``--resume``, the default, keeps) or a parts folder itself (every unit in
it). Prints the tables of :mod:`confu_jax.bench.breakdown` (the benchmark's own .md has them too when
it was written with its parts); ``--json`` / ``--md`` also write them. Definitions: the module
docstring of ``confu_jax.bench.breakdown``.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from confu_jax import storage

flags.DEFINE_string("edges", "0,16,32,64,128", "answer-position bucket edges: [e0,e1), [e1,e2), ..., [eK,inf)")
flags.DEFINE_bool("include_ar", False, "also tabulate AR units (tau 1 everywhere)")
flags.DEFINE_string("json", "", "write the breakdowns as JSON here")
flags.DEFINE_string("md", "", "write the tables as markdown here")
FLAGS = flags.FLAGS


def resolve(path: str) -> tuple[str, list | None]:
    """(parts folder, the results rows whose units to take, or None for all) of the argument."""
    from confu_jax.bench.report import load_results

    if storage.isfile(path):
        parts = os.path.splitext(path)[0] + ".parts"
        if not storage.isdir(parts):
            raise ValueError(f"{path}: no parts folder {parts} beside it (the benchmark ran with --resume=false, "
                             "or its parts were deleted): the per-pass logs are only kept there")
        try:
            rows = load_results(path)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a decode_bench results file ({e})") from None
        return parts, rows
    if storage.isdir(path):
        if not any(n.endswith(".json") and n != "settings.json" for n in storage.listdir(path)):
            raise ValueError(f"{path}: no benchmark units (<key>.json) in this folder; expected a "
                             "decode_bench results .json or its .parts folder")
        return path, None
    raise ValueError(f"{path}: no such file or folder")


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("expected one argument: a decode_bench results .json or its .parts folder")
    from confu_jax.bench import breakdown
    from confu_jax.bench.report import _json_clean

    try:
        edges = [int(e) for e in FLAGS.edges.split(",")]
        parts, rows = resolve(argv[1])
        units = breakdown.load_units(parts, rows)
        result = breakdown.breakdown_rows(units, edges, skip_ar=not FLAGS.include_ar)
    except ValueError as e:
        raise app.UsageError(str(e))
    if not result:
        raise app.UsageError(f"{parts}: no speculative units to break down (found {len(units)} unit(s); "
                             "AR units need --include_ar)")
    tables = breakdown.markdown_tables(result)
    print(tables)
    if FLAGS.md:
        storage.write_text(FLAGS.md, tables)
    if FLAGS.json:
        storage.write_text(FLAGS.json, json.dumps(_json_clean(result), indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.tau_breakdown", main)
