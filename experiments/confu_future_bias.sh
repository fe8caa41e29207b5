#!/usr/bin/env bash
# Does a learned future-entry bias make ConFu read its future? (docs/RESULTS.md "Does ConFu use its
# future?"; HeadConfig.future_bias, docs/DESIGN.md §4 item 13.)
#
# The released ConFu head gives its future entry ~0.1% of its attention, and a weight near 0 gets a
# gradient near 0. Two continuations of that release on the same data, seed and steps — the paper's
# head, and the same head with a per-head logit on the entry's score starting at BIAS — each
# evaluated on the same held-out rows before (--eval_only) and after training. The held-out
# evaluation reports, with and without the entry: decode-path τ, conditional acceptance, and the
# attention weight the entry gets (future/attn_weight/step{r}).
#
#   bash experiments/confu_future_bias.sh                     # CPU: STEPS=40 of 4 x 1024 tokens
#   STEPS=100 ROWS=32 LEN=2048 DTYPE=bfloat16 bash experiments/confu_future_bias.sh   # larger, where the deps are installed
#
# INIT (default: the ConFu release) must be a trainable-tree export or release: its draft_vocab.npz is
# the runs' draft vocabulary, so its LM head is copied column for column.
# Resumable: a finished stage (its eval_only.json or final checkpoint) is skipped; launch.train
# resumes a stopped run. The table at the end is also written to $OUT/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}
BIAS=${BIAS:-4.0}
ROWS=${ROWS:-4}
LEN=${LEN:-1024}
K_TRAIN=${K_TRAIN:-128}
LR=${LR:-2e-4}
EVAL_BATCHES=${EVAL_BATCHES:-4}
DTYPE=${DTYPE:-float32}
INIT=${INIT:-releases/heads/smollm2_confu}
OUT=${OUT:-runs/future_bias}

common=(--config configs/smollm2_confu.py
        "--config.train.checkpoint.init_from=$INIT"
        --config.data.train_files=releases/data/sharegpt_smollm2_gpu,releases/data/sharegpt_smollm2
        "--config.data.max_length=$LEN" "--config.data.global_batch_size=$ROWS" --config.data.pack=True
        --config.data.min_loss_tokens=1 --config.data.num_workers=0 "--config.data.draft_vocab_path=$INIT/draft_vocab.npz"
        --config.draft.draft_vocab_size=4096 --config.draft.ttt_steps=4 --config.confu.max_lag=4
        "--config.objective.k_train=$K_TRAIN" "--config.objective.eval_batches=$EVAL_BATCHES"
        "--config.model.dtype=$DTYPE" "--config.model.param_dtype=$DTYPE" "--config.draft.dtype=$DTYPE"
        --config.train.progress_bar=False --config.train.tensorboard=off)
train=("--config.train.steps=$STEPS" "--config.train.optim.lr=$LR" --config.train.optim.warmup_steps=5
       --config.train.optim.end_lr_ratio=0.1 "--config.train.eval_every=$STEPS" --config.train.log_every=1
       "--config.train.checkpoint.every=$STEPS" --config.train.checkpoint.keep=1)

mkdir -p "$OUT"
for arm in paper bias; do
  extra=()
  [ "$arm" = bias ] && extra=("--config.confu.future_bias=$BIAS")
  if [ ! -f "$OUT/${arm}_start/eval_only.json" ]; then
    echo "== $arm: held-out evaluation at the start ($(date -u +%H:%M:%S))"
    python -m launch.train --eval_only --workdir "$OUT/${arm}_start" "${common[@]}" "${extra[@]}" \
      > "$OUT/${arm}_start.log" 2>&1
  fi
  if [ ! -d "$OUT/$arm/checkpoints/$STEPS" ]; then
    echo "== $arm: $STEPS steps ($(date -u +%H:%M:%S))"
    python -m launch.train --workdir "$OUT/$arm" "${common[@]}" "${extra[@]}" "${train[@]}" \
      >> "$OUT/$arm.log" 2>&1
  fi
done
echo "== done ($(date -u +%H:%M:%S))"
python - "$OUT" "$STEPS" <<'PY'
import csv, json, os, sys
out, steps = sys.argv[1], int(sys.argv[2])
keys = ["decode_tau/chain3", "no_future/decode_tau/chain3", "cond_acc/step0", "no_future/cond_acc/step0",
        "future/attn_weight/step0", "future/attn_weight/step1", "future/attn_weight/step2", "future/attn_weight/step3",
        "future/f_top1_x1", "future/f_top1_x2", "loss"]
rows = {}
for arm in ("paper", "bias"):
    with open(os.path.join(out, f"{arm}_start", "eval_only.json")) as f:
        rows[f"{arm}@0"] = json.load(f)["eval"]
    with open(os.path.join(out, arm, "eval.csv")) as f:
        last = [r for r in csv.DictReader(f) if int(r["step"]) == steps]
    rows[f"{arm}@{steps}"] = {k: float(v) for k, v in last[-1].items() if v not in ("", None)}
print("metric".ljust(30) + "".join(name.rjust(12) for name in rows))
for k in keys:
    print(k.ljust(30) + "".join(f"{r.get(k, float('nan')):12.4f}" for r in rows.values()))
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({name: {k: r.get(k) for k in keys} for name, r in rows.items()}, f, indent=1)
PY
