#!/usr/bin/env bash
# Does ConFu read its future? Continuations of the ConFu release under the paper's objective and under
# this project's future mechanisms, at equal compute (same data, seed, batches, steps and schedule),
# each evaluated on the same held-out rows before (--eval_only) and after training (docs/RESULTS.md
# "Why ConFu ignores its future", "A direct training signal for the future"; docs/DESIGN.md §4).
#
# Arms (ARMS, space-separated; each adds flags to the same run):
#   paper     the paper's head and objective
#   bias      a learned logit on the future entry's attention score, starting at BIAS (confu.future_bias)
#   aux       an auxiliary loss training f to name x[t+2 .. t+1+AHEAD] through the target's LM head
#             (objective.future_aux_weight = AUX, future_aux_ahead = AHEAD)
#   aux_bias  both
#   input     f also enters the first draft step's input through a learned map starting at zero
#             (confu.future_input)
#   aux_input the auxiliary loss and f in the first step
#   taps      f is the contemplate's taps at the EAGLE-3 layers, read through the draft's fc like every other
#             position (confu.future_taps), not its last layer
#   aux_input_taps  aux_input with f as taps
#   eagle3    the control: the EAGLE-3 release continued under its own objective on the same data, seed,
#             batches, steps and schedule (INIT_EAGLE3; the two releases are at equal compute, ConFu
#             trained from EAGLE-3's midpoint, so the continued pair is too)
#   <arm>_gc  that arm with gradients clipped per group (train.optim.clip_per_group: the draft and the
#             contemplate path each to the clip norm, so the auxiliary loss's large gradients do not shrink
#             the draft's update)
# The held-out evaluation reports, with and without the entry: decode-path τ, conditional acceptance,
# the attention weight the entry gets (future/attn_weight/step{r}), what f names (future/f_top1_x{s})
# and f's cross-entropy on x[t+2] (future/aux_ce_x2).
#
#   bash experiments/confu_future.sh                          # CPU: STEPS=40 of 4 x 1024 tokens, ARMS="paper aux"
#   ARMS="paper bias aux aux_bias" STEPS=100 ROWS=32 LEN=2048 DTYPE=bfloat16 bash experiments/confu_future.sh
#
# INIT (default: the ConFu release) must be a trainable-tree export or release: its draft_vocab.npz is
# the runs' draft vocabulary, so its LM head is copied column for column. INIT=none (and
# INIT_EAGLE3=none) trains from scratch instead, on the same draft vocabulary (VOCAB, default the
# ConFu release's): the paper's other protocol, ConFu and EAGLE-3 from nothing at equal compute.
#   INIT=none INIT_EAGLE3=none ARMS="eagle3 aux_input_gc" STEPS=120 OUT=runs/confu_future_scratch \
#     bash experiments/confu_future.sh
# Resumable: a finished stage (its eval_only.json or final checkpoint) is skipped; launch.train
# resumes a stopped run. The table at the end is also written to $OUT/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}
BIAS=${BIAS:-4.0}
AUX=${AUX:-1.0}
AHEAD=${AHEAD:-2}
ARMS=${ARMS:-paper aux}
ROWS=${ROWS:-4}
LEN=${LEN:-1024}
K_TRAIN=${K_TRAIN:-128}
LR=${LR:-2e-4}
EVAL_BATCHES=${EVAL_BATCHES:-4}
DTYPE=${DTYPE:-float32}
INIT=${INIT:-releases/heads/smollm2_confu}
INIT_EAGLE3=${INIT_EAGLE3:-releases/heads/smollm2_eagle3}
VOCAB=${VOCAB:-releases/heads/smollm2_confu/draft_vocab.npz}
OUT=${OUT:-runs/confu_future}

# the EAGLE-3 release keeps its vocabulary maps inside its safetensors (speculators' layout); they are
# the ConFu release's draft_vocab.npz, id for id, so both arms read that one
common=(--config.data.train_files=releases/data/sharegpt_smollm2_gpu,releases/data/sharegpt_smollm2
        "--config.data.max_length=$LEN" "--config.data.global_batch_size=$ROWS" --config.data.pack=True
        --config.data.min_loss_tokens=1 --config.data.num_workers=0 "--config.data.draft_vocab_path=$VOCAB"
        --config.draft.draft_vocab_size=4096 --config.draft.ttt_steps=4 --config.confu.max_lag=4
        "--config.objective.k_train=$K_TRAIN" "--config.objective.eval_batches=$EVAL_BATCHES"
        "--config.model.dtype=$DTYPE" "--config.model.param_dtype=$DTYPE" "--config.draft.dtype=$DTYPE"
        --config.train.progress_bar=False --config.train.tensorboard=off)
train=("--config.train.steps=$STEPS" "--config.train.optim.lr=$LR" --config.train.optim.warmup_steps=5
       --config.train.optim.end_lr_ratio=0.1 "--config.train.eval_every=$STEPS" --config.train.log_every=1
       "--config.train.checkpoint.every=$STEPS" --config.train.checkpoint.keep=1)

mkdir -p "$OUT"
for arm in $ARMS; do
  gc=()
  base="$arm"
  if [[ "$arm" == *_gc ]]; then gc=(--config.train.optim.clip_per_group=True); base="${arm%_gc}"; fi
  case "$base" in
    paper|eagle3) extra=() ;;
    bias) extra=("--config.confu.future_bias=$BIAS") ;;
    aux) extra=("--config.objective.future_aux_weight=$AUX" "--config.objective.future_aux_ahead=$AHEAD") ;;
    aux_bias) extra=("--config.confu.future_bias=$BIAS" "--config.objective.future_aux_weight=$AUX"
                     "--config.objective.future_aux_ahead=$AHEAD") ;;
    input) extra=(--config.confu.future_input=True) ;;
    aux_input) extra=(--config.confu.future_input=True "--config.objective.future_aux_weight=$AUX"
                      "--config.objective.future_aux_ahead=$AHEAD") ;;
    taps) extra=(--config.confu.future_taps=True) ;;
    aux_input_taps) extra=(--config.confu.future_input=True --config.confu.future_taps=True
                           "--config.objective.future_aux_weight=$AUX" "--config.objective.future_aux_ahead=$AHEAD") ;;
    *) echo "unknown arm '$arm' (expected eagle3, paper, bias, aux, aux_bias, input, aux_input, taps, aux_input_taps, each with an optional _gc)" >&2; exit 2 ;;
  esac
  extra+=("${gc[@]}")
  head=(--config configs/smollm2_confu.py)
  [[ "$INIT" != none ]] && head+=("--config.train.checkpoint.init_from=$INIT")
  # the head at step 0 differs only with a bias or with f as taps (future_input's map starts at zero: the
  # paper's head; the objective does not change the start's evaluation)
  start=paper_start
  [[ "$base" == *bias ]] && start=bias_start
  [[ "$base" == *taps ]] && start=taps_start
  if [[ "$base" == eagle3 ]]; then
    head=(--config configs/smollm2_eagle3.py)
    [[ "$INIT_EAGLE3" != none ]] && head+=("--config.train.checkpoint.init_from=$INIT_EAGLE3")
    start=eagle3_start
  fi
  from="$INIT"; [[ "$base" == eagle3 ]] && from="$INIT_EAGLE3"
  if [[ "$from" != none ]] && [ ! -f "$OUT/$start/eval_only.json" ]; then  # from scratch: no start to evaluate
    echo "== $start: held-out evaluation at the start ($(date -u +%H:%M:%S))"
    python -m launch.train --eval_only --workdir "$OUT/$start" "${head[@]}" "${common[@]}" "${extra[@]}" \
      > "$OUT/$start.log" 2>&1
  fi
  if [ ! -d "$OUT/$arm/checkpoints/$STEPS" ]; then
    echo "== $arm: $STEPS steps ($(date -u +%H:%M:%S))"
    python -m launch.train --workdir "$OUT/$arm" "${head[@]}" "${common[@]}" "${extra[@]}" "${train[@]}" \
      >> "$OUT/$arm.log" 2>&1
  fi
done
echo "== done ($(date -u +%H:%M:%S))"
python - "$OUT" "$STEPS" $ARMS <<'PY'
import csv, json, os, sys
out, steps, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
keys = ["decode_tau/chain3", "no_future/decode_tau/chain3", "cond_acc/step0", "no_future/cond_acc/step0",
        "future/attn_weight/step0", "future/attn_weight/step1", "future/attn_weight/step2", "future/attn_weight/step3",
        "future/f_top1_x1", "future/f_top1_x2", "future/f_top1_x3", "future/aux_ce_x2", "loss"]
rows = {}
def start_of(arm):
    base = arm.removesuffix("_gc")
    if base == "eagle3":
        return "eagle3_start"
    return "bias_start" if base.endswith("bias") else "taps_start" if base.endswith("taps") else "paper_start"
for start in sorted({start_of(a) for a in arms}):
    if not os.path.exists(os.path.join(out, start, "eval_only.json")):  # trained from scratch
        continue
    with open(os.path.join(out, start, "eval_only.json")) as f:
        rows[start.replace("_start", "@0")] = json.load(f)["eval"]
for arm in arms:
    with open(os.path.join(out, arm, "eval.csv")) as f:
        last = [r for r in csv.DictReader(f) if int(r["step"]) == steps]
    rows[f"{arm}@{steps}"] = {k: float(v) for k, v in last[-1].items() if v not in ("", None)}
print("metric".ljust(30) + "".join(name.rjust(12) for name in rows))
for k in keys:
    print(k.ljust(30) + "".join(f"{r.get(k, float('nan')):12.4f}" for r in rows.values()))
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({name: {k: r.get(k) for k in keys} for name, r in rows.items()}, f, indent=1)
PY
