#!/usr/bin/env bash
# The scaling curve at CPU scale: held-out τ of EAGLE-3 and ConFu against tokens seen, both
# trained from scratch on identical batches (the repository's data releases, packed rows of
# ROWS x LEN >= 8k tokens), evaluated and kept at doubling milestones, then decoded on held-out
# conversations (chain:3 and a 60-node dynamic tree) and fitted (docs/RESULTS.md "Scaling curve").
#
#   bash experiments/scaling_curve.sh train     # background-friendly; resumes after a kill
#   bash experiments/scaling_curve.sh measure   # decodes every milestone (tau only: no timing is reported)
#   bash experiments/scaling_curve.sh fit       # table, fit, figure -> docs/results/scaling_curve.*
#
# Schedule: warm-up, then the peak learning rate held (WSD, optim.schedule=wsd) until the last 20% of
# SCHEDULE steps; the runs stop at STEPS, before the decay, so every milestone sits at the same learning
# rate (a cosine would anneal the later points more than the earlier ones and bend the curve).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${SCALING_OUT:-runs/scaling}
STEPS=${SCALING_STEPS:-48}
# the learning-rate schedule's length (optim.schedule_steps): longer than STEPS stops every run on
# the stable part of one longer WSD schedule, so no point (the last included) is annealed
SCHEDULE=${SCALING_SCHEDULE:-64}
MILESTONES=${SCALING_MILESTONES:-4,8,16,32,48}
ROWS=${SCALING_ROWS:-8}
LEN=${SCALING_LEN:-1024}
VOCAB=${SCALING_VOCAB:-4096}
DATA=${SCALING_DATA:-releases/data/sharegpt_smollm2,releases/data/sharegpt_smollm2_gpu}
RESULTS=${SCALING_RESULTS:-docs/results/scaling_curve}
mkdir -p "$OUT"

common="--config.data.train_files=$DATA --config.data.max_length=$LEN --config.data.global_batch_size=$ROWS \
 --config.data.pack=True --config.data.num_workers=0 \
 --config.draft.draft_vocab_size=$VOCAB --config.data.draft_vocab_size=$VOCAB --config.draft.ttt_steps=4 \
 --config.train.optim.lr=0.001 --config.train.optim.warmup_steps=4 --config.train.optim.schedule=wsd \
 --config.train.optim.decay_ratio=0.2 --config.train.milestones=$MILESTONES --config.objective.eval_batches=3 \
 --config.train.checkpoint.every=8 --config.train.checkpoint.keep=1 --config.train.log_every=1 \
 --config.train.eval_every=0 --config.train.progress_bar=False --config.train.tensorboard=off"

train() {  # name config [extra flags]: skipped when its last checkpoint exists; wall seconds in $OUT/<name>.wall
    local name=$1 config=$2
    shift 2
    if [ -d "$OUT/$name/checkpoints/$STEPS" ]; then echo "$name: done"; return; fi
    echo "$name: $STEPS steps ($(date -u +%H:%M:%S))"
    local t0=$SECONDS
    nice -n 5 python -m launch.train --config "$config" --workdir "$OUT/$name" $common \
        --config.train.steps="$STEPS" --config.train.optim.schedule_steps="$SCHEDULE" "$@" >> "$OUT/$name.log" 2>&1
    echo $((SECONDS - t0)) >> "$OUT/$name.wall"  # one line per invocation (a resumed run adds one)
}

case "${1:-train}" in
train)
    train eagle3 configs/smollm2_eagle3.py
    train confu configs/smollm2_confu.py --config.objective.k_train=64 --config.confu.max_lag=4
    ;;
measure)
    python -m launch.heldout_questions --data "$DATA" --n "${SCALING_QUESTIONS:-8}" --out "$OUT/heldout.jsonl"
    python -m launch.scaling_curve measure --runs "eagle3=$OUT/eagle3,confu=$OUT/confu" \
        --prompts "$OUT/heldout.jsonl" --budgets "${SCALING_BUDGETS:-chain:3,dynamic:6,10,60}" \
        --max_new_tokens "${SCALING_TOKENS:-128}" --out "$RESULTS.points.json"
    ;;
fit)
    rates=$(python - "$OUT" <<'EOF'
import os, sys
from confu_jax.runs.checkpoint import Checkpointer
from confu_jax.runs.lineage import row_tokens
out, rates = sys.argv[1], []
for name in ("eagle3", "confu"):
    wall = sum(float(x) for x in open(os.path.join(out, f"{name}.wall")).read().split())
    ck = Checkpointer(os.path.join(out, name, "checkpoints"), read_only=True)
    step = ck.latest_step()
    ck.close()
    rates.append(f"{name}={row_tokens(os.path.join(out, name), step) / wall:.1f}")
print(",".join(rates))
EOF
)
    echo "training tokens (rows x length) per second (wall, compiles and evaluations included): $rates"
    python -m launch.scaling_curve fit --points "$RESULTS.points.json${SCALING_EXTRA_POINTS:+,$SCALING_EXTRA_POINTS}" \
        --tokens_per_s "$rates" --min_tokens "${SCALING_MIN_TOKENS:-0}" --out "$RESULTS"
    ;;
*)
    echo "usage: $0 train|measure|fit" >&2
    exit 2
    ;;
esac
