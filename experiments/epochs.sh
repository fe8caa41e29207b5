#!/usr/bin/env bash
# Multi-epoch training on offline target features: does reading a subset of the
# data for several epochs train a head as well as reading as much fresh data once?
#
#   bash experiments/epochs.sh features   # the target's taps + teacher, once, into one store
#   bash experiments/epochs.sh train      # EAGLE-3 from scratch: all rows once vs 1/5 five times vs 1/25 25 times
#   bash experiments/epochs.sh table      # held-out tau at every milestone -> docs/results/epochs.{md,json,png}
#
# Every run trains from scratch on the same store with the same steps, packed rows (~7.8k real
# tokens a step), learning-rate schedule and seed; only data.train_rows (the store's first N
# training conversations, reshuffled each epoch) differs, so at every step the runs have trained on
# the same number of tokens, fresh or repeated. The store's last objective.eval_records
# conversations are held out and evaluated (teacher-forced chain:3 tau, exact for greedy chains) at
# every quarter of the run (train.milestones). The store is written once (~3.7 GB per million tokens)
# and read by every epoch of every run. Each stage resumes after a kill: the store after its last
# complete shard, a run from its last checkpoint; a finished run is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${EPOCHS_OUT:-runs/epochs}
DATA=${EPOCHS_DATA:-releases/data/sharegpt_smollm2,releases/data/sharegpt_smollm2_gpu}
LEN=${EPOCHS_LEN:-1024}
ROWS=${EPOCHS_ROWS:-10}          # packed rows a step: 10 x 1024 slots, ~7.8k real tokens (76% full)
BINS=${EPOCHS_BINS:-40}          # rows the packer fills at once (more: fuller rows)
STEPS=${EPOCHS_STEPS:-32}        # ~ one pass over the store's training conversations (~17 a step)
VOCAB=${EPOCHS_VOCAB:-4096}
RECORDS=${EPOCHS_RECORDS:-600}   # conversations in the store (the last 64 held out)
RUNS=${EPOCHS_RUNS:-fresh,ep5,ep25}
mkdir -p "$OUT"

common="--config.data.train_files=$DATA --config.data.max_length=$LEN --config.draft.draft_vocab_size=$VOCAB \
 --config.data.draft_vocab_size=$VOCAB"

train() {  # name train_rows: skipped when its last checkpoint exists; wall seconds in $OUT/<name>.wall
    local name=$1 rows=$2
    if [ -d "$OUT/$name/checkpoints/$STEPS" ]; then echo "$name: done"; return; fi
    echo "$name: $STEPS steps on $rows rows ($(date -u +%H:%M:%S))"
    local t0=$SECONDS
    nice -n 5 python -m launch.train --config configs/smollm2_eagle3.py --workdir "$OUT/$name" $common \
        --config.data.target_features="$OUT/feats" --config.data.train_rows="$rows" --config.data.pack=True \
        --config.data.pack_bins="$BINS" \
        --config.data.global_batch_size="$ROWS" --config.draft.ttt_steps=4 \
        --config.train.steps="$STEPS" --config.train.optim.lr=0.001 --config.train.optim.warmup_steps=4 \
        --config.train.optim.schedule=wsd --config.train.optim.decay_ratio=0.2 \
        --config.train.milestones="$(seq -s, $((STEPS / 4)) $((STEPS / 4)) "$STEPS")" \
        --config.objective.eval_batches=$((64 / ROWS)) --config.train.eval_every=0 \
        --config.train.checkpoint.every=5 --config.train.checkpoint.keep=1 --config.train.log_every=1 \
        --config.train.progress_bar=False --config.train.tensorboard=off >> "$OUT/$name.log" 2>&1
    echo $((SECONDS - t0)) >> "$OUT/$name.wall"  # one line per invocation (a resumed run adds one)
}

case "${1:-train}" in
features)
    nice -n 5 python -m launch.target_features --config configs/smollm2_eagle3.py --out "$OUT/feats" \
        --top_k 64 --rows_per_shard 64 $common --config.data.max_records="$RECORDS" >> "$OUT/feats.log" 2>&1
    ;;
train)
    # the store's training conversations (all but the last 64, which evaluation holds out)
    n=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['rows'] - 64)" "$OUT/feats/index.json")
    for run in ${RUNS//,/ }; do
        case $run in
        fresh) train fresh "$n" ;;                 # every conversation about once
        ep*) train "$run" $((n / ${run#ep})) ;;    # epN: the first n/N conversations, about N times each
        *) echo "unknown run $run" >&2; exit 2 ;;
        esac
    done
    ;;
table)
    # epochs each run read: its data order replayed (host only, no model); the conversations of a
    # step are the segments of its packed rows
    python - "$OUT" "$RUNS" "$ROWS" "$BINS" "$STEPS" <<'PY' | tee "$OUT/epochs.txt"
import itertools, json, os, sys
from confu_jax.data.target_features import FeatureStore, feature_dataset
out, runs, rows, bins, steps = sys.argv[1], sys.argv[2].split(","), *map(int, sys.argv[3:])
store = FeatureStore(os.path.join(out, "feats"))
for run in runs:
    cfg = json.load(open(os.path.join(out, run, "config.json")))
    n = int(cfg["data"]["train_rows"])
    it = feature_dataset(store, per_host_batch_size=rows, seed=int(cfg["train"]["seed"]), rows=range(n), pack=True,
                         pack_bins=bins)
    convs = tokens = 0
    for b in itertools.islice(iter(it), steps):
        convs += int(b["segment_ids"].max(axis=1).sum())
        tokens += int(b["attention_mask"].sum())
    print(f"{run}: {n} conversations, {steps} steps read {convs} ({convs / n:.2f} epochs), "
          f"{tokens / steps:.0f} real tokens a step")
PY
    runs=$(for r in ${RUNS//,/ }; do printf '%s=%s/%s,' "$r" "$OUT" "$r"; done)
    python -m launch.scaling_curve measure --runs "${runs%,}" --budgets '' --tokens rows --out "$OUT/points.json"
    python -m launch.scaling_curve fit --points "$OUT/points.json" --out docs/results/epochs
    ;;
*)
    echo "usage: $0 features|train|table" >&2
    exit 2
esac
