#!/usr/bin/env bash
# The headline experiment of docs/RESULTS.md ("Headline experiment, self-distilled"), as one
# resumable pipeline: rerun the script after an interruption and every stage continues where it
# stopped (generate_data appends and skips finished conversations; launch.train resumes from its
# last checkpoint; a benchmark stage whose JSON exists is skipped).
#
#   bash experiments/headline.sh                 # all stages, defaults below
#   STAGES=data bash experiments/headline.sh     # one stage: data | eagle3 | confu | lag | bench
#   RECORDS=3000 E3_STEPS=900 bash experiments/headline.sh
#   VARIANTS=confu TEMPS=0 BUDGETS=chain:3 bash experiments/headline.sh   # a shorter run: no ablations
#
# Rows: 2 x 512 tokens per step, packed (first-turn conversations are <= 416 tokens: a row holds one
# whole or several; packing doubles the real tokens per step on this data, docs/RESULTS.md).
# Protocol (the paper's, §4): EAGLE-3 trains E3_STEPS + PLUS_STEPS steps; ConFu and its two ablations
# start from EAGLE-3's checkpoint at E3_STEPS and train PLUS_STEPS, so every head sees the same number
# of optimizer steps. All heads train on SmolLM2's own answers to ShareGPT (self-distillation).
# Benchmark: all 80 MT-Bench questions + HumanEval's first 20, T = 0 and T = 1, chain:3 and budget
# auto (with held-out calibration prompts), 95% bootstrap intervals over questions.
# Runs take hours on a 2-core CPU: start it with nohup, never beside timed work.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/headline}
DATA=${DATA:-$OUT/data/regen_sharegpt_t1.jsonl}
RECORDS=${RECORDS:-6000}          # ShareGPT conversations read (input order); first turns that fit are regenerated
E3_STEPS=${E3_STEPS:-600}         # EAGLE-3 steps before ConFu branches off
PLUS_STEPS=${PLUS_STEPS:-300}     # steps every head trains after the branch point
MAX_NEW=${MAX_NEW:-128}           # tokens per benchmark answer
STAGES=${STAGES:-data,eagle3,confu,lag,bench}
VARIANTS=${VARIANTS:-confu confu_nomoe confu_nomoe_norep}  # the confu stage's runs (ablations last)
TEMPS=${TEMPS:-0,1}               # headline benchmark temperatures
BUDGETS=${BUDGETS:-chain:3,auto}  # headline benchmark draft plans
PROMPTS=${PROMPTS:-mtbench+humaneval:20}
N_PER_CATEGORY=${N_PER_CATEGORY:-0}  # questions per category (seeded sample; 0 = all)
LAG_WEIGHTS=${LAG_WEIGHTS:-(0.69,0.24,0.06,0.01)}  # decode's lag histogram (see the lag stage)
EVAL_BATCHES=${EVAL_BATCHES:-16}  # held-out batches of 2 conversations for eval/acceptance_length (tau_sim)
mkdir -p "$OUT"

has() { [[ ",$STAGES," == *",$1,"* ]]; }

if has data; then
  # first turns only: later answers rarely fit a training row beside the earlier ones; prompts of
  # <= 192 tokens and answers of <= 224 keep every conversation inside one 512-token row
  $PY -m launch.generate_data --output "$DATA" --max_records "$RECORDS" --max_turns 1 --batch_size 32 \
    --max_new_tokens 224 --max_prompt_len 192
fi

COMMON=(--config.train.checkpoint.async_save=False --config.train.eval_every=50 --config.train.log_every=10
  --config.train.optim.lr=1e-3 --config.train.optim.warmup_steps=10 --config.train.progress_bar=False
  --config.data.train_files="$DATA" --config.data.global_batch_size=2 --config.data.max_length=512
  --config.data.pack=True --config.data.min_loss_tokens=1
  --config.data.draft_vocab_max_records=3000 --config.draft.draft_vocab_size=4096 --config.draft.ttt_steps=4
  --config.train.checkpoint.every=50 --config.train.checkpoint.keep=100 --config.objective.eval_batches=$EVAL_BATCHES)
TOTAL=$((E3_STEPS + PLUS_STEPS))

if has eagle3; then
  $PY -m launch.train --config configs/smollm2_eagle3.py --workdir "$OUT/eagle3" "${COMMON[@]}" \
    --config.train.steps=$TOTAL
fi

if has confu; then
  for v in $VARIANTS; do
    $PY -m launch.train --config configs/smollm2_$v.py --workdir "$OUT/$v" "${COMMON[@]}" \
      --config.train.steps=$PLUS_STEPS --config.objective.k_train=64 --config.confu.max_lag=4 \
      --config.confu.eval_lag_weights="$LAG_WEIGHTS" --config.train.checkpoint.init_from="$OUT/eagle3/checkpoints" \
      --config.train.checkpoint.init_from_step=$E3_STEPS
  done
fi

# Lag distribution: ConFu with the contemplate lag drawn from the accepted-length
# histogram measured at decode time (docs/RESULTS.md: 491/170/43/9 passes accepting 0/1/2/3 drafts,
# so lag 1..4 with weights 0.69/0.24/0.06/0.01) instead of uniform on 1..4; compared with ConFu on
# held-out tau_sim at the same step (every ConFu run is evaluated with the lag drawn from that
# histogram: confu.eval_lag_weights) and in its own benchmark (bench/lag.json).
if has lag; then
  $PY -m launch.train --config configs/smollm2_confu.py --workdir "$OUT/confu_lagw" "${COMMON[@]}" \
    --config.train.steps=$PLUS_STEPS --config.objective.k_train=64 --config.confu.max_lag=4 \
    --config.confu.lag_weights="$LAG_WEIGHTS" --config.confu.eval_lag_weights="$LAG_WEIGHTS" \
    --config.train.checkpoint.init_from="$OUT/eagle3/checkpoints" \
    --config.train.checkpoint.init_from_step=$E3_STEPS
fi

if has bench; then
  HEADS="eagle3=$OUT/eagle3,confu=$OUT/confu"  # --heads may name only the run's --methods
  BENCH=(--prompts "$PROMPTS" --n_per_category "$N_PER_CATEGORY" --turns 1 --max_new_tokens "$MAX_NEW")
  # one run for the headline table (AR timed beside every method, so speed-ups are same-run ratios)
  [[ -f "$OUT/bench/headline.json" ]] || $PY -m launch.decode_bench --methods ar,eagle3,confu --heads "$HEADS" \
    "${BENCH[@]}" --temperatures "$TEMPS" --budgets "$BUDGETS" --calibration humaneval --n_calibration 4 \
    --out "$OUT/bench/headline.json"
  # the ablations at the headline's greedy chain setting (when the confu stage trained them); tau is
  # deterministic, so their tau compares with headline.json's on the same questions
  [[ -f "$OUT/bench/ablations.json" || ! -d "$OUT/confu_nomoe_norep" ]] || $PY -m launch.decode_bench \
    --methods ar,confu_nomoe,confu_nomoe_norep \
    --heads "confu_nomoe=$OUT/confu_nomoe,confu_nomoe_norep=$OUT/confu_nomoe_norep" \
    "${BENCH[@]}" --temperatures 0 --budgets chain:3 --out "$OUT/bench/ablations.json"
  # ConFu trained with the lag drawn from the acceptance histogram (the lag stage), same setting
  [[ -f "$OUT/bench/lag.json" || ! -d "$OUT/confu_lagw" ]] || $PY -m launch.decode_bench --methods ar,confu \
    --heads "confu=$OUT/confu_lagw" "${BENCH[@]}" --temperatures 0 --budgets chain:3 --out "$OUT/bench/lag.json"
  echo "copy $OUT/bench/headline.json to docs/results/headline.json once it is final"
fi
