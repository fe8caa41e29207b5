#!/usr/bin/env bash
# ConFu's future variants against their EAGLE-3 control on all 80 MT-Bench first turns, at equal training
# compute: the heads experiments/confu_future.sh trained (the ConFu arms and the `eagle3` arm continue the
# two releases — themselves at equal compute — on the same data, seed, batches, steps and schedule).
# Chain:3 and a 30-node dynamic tree, T = 0 (every row checked token for token against AR) and T = 1,
# interleaved; then docs/results/confu_future.json: per variant and setting, τ, ConFu / EAGLE-3 τ paired by
# question with its 95% bootstrap interval, the question count and the losslessness check.
#
#   OUT=runs/confu_future VARIANTS="aux_input_gc paper" bash experiments/confu_future_mtbench.sh
#
# One decode_bench run per variant (one head per method name); the EAGLE-3 control runs beside the first
# variant only (its τ does not depend on what runs beside it; at T = 1 the seed fixes the draws).
# Resumable: a finished variant's results JSON is kept. Nothing else should share the cores while it
# runs if the speed-ups it also records are to be read.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/confu_future}
VARIANTS=${VARIANTS:-aux_input_gc}
BUDGETS=${BUDGETS:-chain:3,dynamic:6,8,30}
TEMPS=${TEMPS:-0,1}
N_PER_CATEGORY=${N_PER_CATEGORY:-0}
MAX_NEW=${MAX_NEW:-128}
RESULT=${RESULT:-docs/results/confu_future.json}

first=1
for v in $VARIANTS; do
  res="$OUT/mtbench_$v.json"
  if [ ! -f "$res" ]; then
    if [ $first = 1 ]; then methods=ar,eagle3,confu; heads="eagle3=$OUT/eagle3,confu=$OUT/$v"
    else methods=confu; heads="confu=$OUT/$v"; fi
    echo "== $v ($(date -u +%H:%M:%S))"
    python -m launch.decode_bench --methods "$methods" --heads "$heads" --prompts mtbench \
      --n_per_category "$N_PER_CATEGORY" --budgets "$BUDGETS" --temperatures "$TEMPS" \
      --max_new_tokens "$MAX_NEW" --interleave --out "$res" > "$OUT/mtbench_$v.log" 2>&1
  fi
  first=0
done
first_v=${VARIANTS%% *}
python - "$OUT" "$RESULT" "$first_v" "$BUDGETS" "$TEMPS" "$*" $VARIANTS <<'PY'
import json, os, subprocess, sys
from confu_jax.bench.compare import compare, find_row
out, result, first, budgets, temps, _, *variants = sys.argv[1:]
reference = os.path.join(out, f"mtbench_{first}.json")
with open(reference) as f:
    ref_rows = json.load(f)["results"]
settings = sorted({(r["budget"], float(r["temperature"])) for r in ref_rows if r["method"] == "eagle3"})
rows = []
for budget, temp in settings:
    e3 = find_row(reference, "eagle3", temp, budget)
    rows.append({"variant": "eagle3 (control)", "budget": budget, "temperature": temp,
                 "tau": e3["tau"], "ratio_to_eagle3": 1.0, "ci_low": 1.0, "ci_high": 1.0,
                 "n_questions": e3["n_questions"], "lossless": e3.get("lossless_greedy")})
    for v in variants:
        row = find_row(os.path.join(out, f"mtbench_{v}.json"), "confu", temp, budget)
        c = compare(row, e3)
        rows.append({"variant": v, "budget": budget, "temperature": temp, "tau": c["tau"]["row"],
                     "ratio_to_eagle3": c["tau_ratio"]["ratio"], "ci_low": c["tau_ratio"]["ci"][0],
                     "ci_high": c["tau_ratio"]["ci"][1], "n_questions": c["n_questions"],
                     "lossless": row.get("lossless_greedy")})
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
doc = {"rows": rows,
       "lossless_note": "T = 0 rows: every answer equal to AR's token for token (true), checked in the run; "
                        "T = 1 rows (null): the sampled rule is exact by construction and tested by chi-square "
                        "in the suite (tests/unit/test_spec_loop.py, tests/helpers/family_checks.py), not checkable per token",
       "heads": {v: os.path.join(out, v) for v in ["eagle3", *variants]},
       "command": f"OUT={out} VARIANTS=\"{' '.join(variants)}\" bash experiments/confu_future_mtbench.sh",
       "commit": commit}
os.makedirs(os.path.dirname(result) or ".", exist_ok=True)
with open(result, "w") as f:
    json.dump(doc, f, indent=1)
for r in rows:
    print(f"{r['variant']:18s} {r['budget']:16s} T={r['temperature']:g}  tau {r['tau']:.3f}  ratio "
          f"{r['ratio_to_eagle3']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]  n={r['n_questions']} "
          f"lossless={r['lossless']}")
PY
