#!/usr/bin/env bash
# Trainer parity (docs/training.md "Trainer parity"): EAGLE-3 for SmolLM2 trained by speculators 0.9's own trainer
# and by ours on the same rows, then both served in our loop, side by side. Every stage is resumable and skipped
# when done; run it again after a kill. Background, niced, logged under $OUT/logs:
#
#   nohup bash experiments/trainer_parity.sh > /dev/null 2>&1 &
#
# PARITY_OUT (runs/parity), PARITY_RECORDS (2000 conversations of releases/data/sharegpt_smollm2: ~0.95 M
# tokens), PARITY_STEPS (110 steps of 8192 tokens: under one pass of the reference's packed epoch, which it
# must not cross: its max_steps is not checked between epochs), PARITY_STAGES (prepare,hidden,ours,ref,eval),
# PARITY_VARIANTS (more runs of ours, one change each: trainer_parity.VARIANTS, e.g. muon,decay1,lk; none by default),
# PARITY_THREADS (2: torch threads of the hidden-state pass).
# The two trainers run one after the other (two cores): ours online (~52 s a step here), the reference on
# stored hidden states (hidden: ~30 rows a minute a core, ~17 GB of float32 for the default rows).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${PARITY_OUT:-runs/parity}
RECORDS=${PARITY_RECORDS:-2000}
STEPS=${PARITY_STEPS:-110}
STAGES=${PARITY_STAGES:-prepare,hidden,ours,ref,eval}
PARITY_VARIANTS=${PARITY_VARIANTS:-}
N_PER_CATEGORY=${PARITY_N_PER_CATEGORY:-3}
PY=${PYTHON:-python}
mkdir -p "$OUT/logs"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

if has prepare && [ ! -f "$OUT/prepare.json" ]; then
    stamp prepare
    nice -n 10 $PY -m experiments.trainer_parity prepare --out "$OUT" --max_records "$RECORDS" > "$OUT/logs/prepare.log" 2>&1
fi
if has hidden; then
    stamp "hidden states (resumes)"
    nice -n 10 $PY -m experiments.trainer_parity hidden --out "$OUT" --threads "${PARITY_THREADS:-2}" >> "$OUT/logs/hidden.log" 2>&1
fi
if has ours && [ ! -d "$OUT/ours/checkpoints/$STEPS" ]; then
    stamp "ours: $STEPS steps (resumes)"
    nice -n 10 $PY -m experiments.trainer_parity train_ours --out "$OUT" --steps "$STEPS" >> "$OUT/logs/ours.log" 2>&1
fi
# the recipe comparison (PARITY_VARIANTS): our run again with one change, everything else equal (same rows,
# steps, schedule): benched beside ours by the eval stage
for v in ${PARITY_VARIANTS//,/ }; do
    if [ ! -d "$OUT/ours_$v/checkpoints/$STEPS" ]; then
        stamp "ours_$v: $STEPS steps (resumes)"
        nice -n 10 $PY -m experiments.trainer_parity train_ours --out "$OUT" --steps "$STEPS" --variant "$v" \
            >> "$OUT/logs/ours_$v.log" 2>&1
    fi
done
if has ref; then
    done_step=$($PY -c "import json,sys; print(json.load(open(sys.argv[1])).get('global_step', 0))" \
        "$OUT/reference/checkpoints/0/training_state.json" 2>/dev/null || echo 0)
    if [ "$done_step" -lt "$STEPS" ]; then
        stamp "reference: $STEPS steps (resumes from step $done_step)"
        nice -n 10 $PY -m experiments.trainer_parity train_ref --out "$OUT" --steps "$STEPS" >> "$OUT/logs/ref.log" 2>&1
    fi
fi
if has eval; then
    # ours exported in speculators' layout (what vLLM serves) in bf16, as released; the reference wrote that
    # layout itself, in bf16
    # (the variants too: each compared with ours as both are served, in bf16)
    heads="ours reference"
    for v in ${PARITY_VARIANTS//,/ }; do heads="$heads ours_$v"; done
    for head in $heads; do
        [ "$head" = reference ] || [ -f "$OUT/heads/$head/model.safetensors" ] || \
            $PY -m launch.export_head --workdir "$OUT/$head" --format speculators --out "$OUT/heads/$head" \
                --verifier "$OUT/target" --dtype bfloat16 > "$OUT/logs/export_$head.log" 2>&1
    done
    mkdir -p "$OUT/bench"
    for head in $heads; do
        dir="$OUT/heads/$head"; [ "$head" = reference ] && dir="$OUT/reference/checkpoints/0"
        for prompts in mtbench grounded; do
            [ -f "$OUT/bench/${head}_${prompts}.json" ] && continue
            stamp "bench $head $prompts"
            nice -n 10 $PY -m launch.decode_bench --methods ar,eagle3 --heads "eagle3=$dir" --temperatures 0,1 \
                --budgets chain:3 --prompts "$prompts" --n_per_category "$N_PER_CATEGORY" --turns 1 \
                --max_new_tokens 128 --out "$OUT/bench/${head}_${prompts}.json" >> "$OUT/logs/bench.log" 2>&1
        done
    done
    # vLLM's CPU build serves both heads on the same questions' first turns, T = 0 and 1, counted per prompt
    VLLM_PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
    for prompts in mtbench grounded; do
        ids=$($PY -m experiments.trainer_parity vllm_prompts --out "$OUT" --prompts "$prompts" \
            --n_per_category "$N_PER_CATEGORY" | tail -1)
        for head in ours reference; do
            dir="$OUT/heads/ours"; [ "$head" = reference ] && dir="$OUT/reference/checkpoints/0"
            for t in 0 1; do
                res="$OUT/vllm/${head}_${prompts}_T$t.json"
                [ -f "$res" ] && continue
                stamp "vllm $head $prompts T=$t"
                nice -n 10 $VLLM_PY experiments/vllm_cpu.py --model "$OUT/target" --prompts "$ids" --out "$res" \
                    --spec_method eagle3 --spec_model "$dir" --k 3 --max_tokens 128 --temperature "$t" \
                    --per_prompt >> "$OUT/logs/vllm.log" 2>&1
            done
        done
        for t in 0 1; do
            $PY -m experiments.trainer_parity vllm_compare --out "$OUT" --row "$OUT/vllm/ours_${prompts}_T$t.json" \
                --reference "$OUT/vllm/reference_${prompts}_T$t.json" --ids "${ids%.json}.ids.json" \
                --json_out "$OUT/vllm/compare_${prompts}_T$t.json" | tee -a "$OUT/logs/compare.log"
        done
    done
    bench_compare() {  # ROW REFERENCE NAME: our loop's τ of two heads, paired by question, each set and T
        for prompts in mtbench grounded; do
            for t in 0 1; do
                $PY -m launch.tau_compare --row "$OUT/bench/$1_${prompts}.json:eagle3" \
                    --reference "$OUT/bench/$2_${prompts}.json:eagle3" --temperature "$t" --budget chain:3 \
                    --json_out "$OUT/bench/compare_$3${prompts}_T$t.json" | tee -a "$OUT/logs/compare.log"
            done
        done
    }
    bench_compare ours reference ""
    for v in ${PARITY_VARIANTS//,/ }; do bench_compare "ours_$v" ours "${v}_"; done
    # every figure in one record (docs/results/trainer_parity.json) and the table
    $PY -m experiments.trainer_parity report --out "$OUT" --variants "$PARITY_VARIANTS" \
        --json_out "$OUT/trainer_parity.json" | tee "$OUT/logs/report.log"
fi
stamp done
