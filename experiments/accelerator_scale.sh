#!/usr/bin/env bash
# What only an accelerator can answer about the 8B scale, in one command for a GPU node (one device
# call: budget the whole call with DEADLINE_S). Each stage writes one JSON under $OUT; a stage whose
# JSON exists is skipped, so a rerun after a time-out continues. Stages run in priority order; one
# that fails or outlives STAGE_TIMEOUT_S leaves <name>.failed (its log's tail) and the next one runs;
# none starts once DEADLINE_S seconds have passed since the script began (0 = no deadline).
#
#   DEADLINE_S=420 bash experiments/accelerator_scale.sh   # on the GPU
#   DRY_RUN=1 bash experiments/accelerator_scale.sh        # tiny shapes on a CPU (tests/e2e/test_accelerator_scale.py)
#
#   (i)   the Pallas tree-attention kernel executed at Llama-3.1-8B decode shapes: equal to the XLA path
#         on the device, time and GB/s against the HBM peak (trees of 30 / 60 nodes, 2T queries with
#         the contemplates, caches of 2k / 8k): launch.kernel_bench
#   (iii) SmolLM2's shapes, fp32, AR and speculative passes measured with XLA command buffers (CUDA
#         graphs) on and off (the small target is launch-bound: 1.8 ms a token, ~30x its memory floor
#         on the H200): launch.decode_cost --measure --measure_model random:smollm2-135m, twice (random
#         weights: a pass costs the same whatever the values, and nothing need travel to the device)
#   (v)   the measured 8B decode step: Llama-3.1-8B's shapes in bf16 with random weights on one device,
#         the AR step and one EAGLE-3 / ConFu chain:3 iteration (32k-row draft heads), against the
#         memory floor: launch.decode_cost --measure --measure_model random:llama-3.1-8b
#   (iv)  the 8B training step on one device, random weights (cost does not depend on values): rows of
#         4096 then 2048, EAGLE-3 and ConFu; step time, tokens/s, MFU, peak memory:
#         launch.train --compile_only --time_steps --config.model.source=abstract; with the target's
#         training attention in XLA's flash form and through the fused Pallas kernel (model.flash_impl,
#         FLASH; kernels.fused_attention), side by side
#   (ii)  the 8B decode cost table in bf16, shape-only (XLA's cost analysis of the AR step and
#         verification at T = 4 .. 64: bytes against the memory floor): launch.decode_cost
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/accelerator_scale}
DEADLINE_S=${DEADLINE_S:-0}
STAGE_TIMEOUT_S=${STAGE_TIMEOUT_S:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
FAILED=0
log() { echo "[accelerator_scale $(date +%H:%M:%S) +$((SECONDS - START))s] $*"; }

if [ "${DRY_RUN:-0}" = "1" ]; then
  KB=(--model tiny --seq_lens=64 --tree_sizes=4 --impls=xla --warmup=0 --iters=1 --repeats=1)
  DC=(--models tiny --caches 64 --tokens 1,4 --dtype float32)
  MEAS=(--prompt_len 20 --new_tokens 8 --repeats 2 --draft_vocab 64)
  SMALL=random:tiny
  BIG=random:tiny
  BIG_VOCAB=64
  TRAIN=(--config.model.preset=tiny --config.objective.k_train=8)
  ROWS=${ROWS:-64}
  FLASH=${FLASH:-xla}
  MEASURE=1
else
  KB=(--model llama-3.1-8b --seq_lens=2048,8192 --tree_sizes=30,60)
  DC=(--models llama-3.1-8b --caches 2048,8192 --tokens 1,4,8,16,32,64,128 --dtype model)
  MEAS=()
  SMALL=random:smollm2-135m
  BIG=random:llama-3.1-8b
  BIG_VOCAB=32000
  TRAIN=(--config.model.preset=llama-3.1-8b)
  ROWS=${ROWS:-4096,2048}
  FLASH=${FLASH:-xla,pallas}
  MEASURE=1
  # a rerun on the same (warm) machine skips the compiles the first call made
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$OUT/jax_cache}
fi

# stage NAME CMD...: run CMD (which writes $OUT/NAME.json.tmp) unless $OUT/NAME.json exists, the
# deadline has passed or an earlier try failed in this call; its output goes to $OUT/NAME.log.
stage() {
  local name=$1
  shift
  [ -f "$OUT/$name.json" ] && return 0
  if [ "$DEADLINE_S" != 0 ] && [ $((SECONDS - START)) -ge "$DEADLINE_S" ]; then
    log "skipped $name: past the ${DEADLINE_S}s deadline"
    return 0
  fi
  log "$name: $*"
  local t=()
  [ "$STAGE_TIMEOUT_S" != 0 ] && t=(timeout --signal=TERM --kill-after=10 "$STAGE_TIMEOUT_S")
  # through the script itself (its functions and settings), so that timeout can stop a stage
  if "${t[@]}" bash "$SELF" __run "$@" > >(tee "$OUT/$name.log") 2>&1 && [ -f "$OUT/$name.json.tmp" ]; then
    mv "$OUT/$name.json.tmp" "$OUT/$name.json"
    rm -f "$OUT/$name.failed"
    log "$name: done"
  else
    local rc=$?
    tail -c 4000 "$OUT/$name.log" > "$OUT/$name.failed"
    FAILED=$((FAILED + 1))
    log "$name: FAILED (exit $rc; $OUT/$name.failed)"
  fi
}

kernel() {
  $PY -m launch.kernel_bench "${KB[@]}" --json_out="$OUT/kernel.json.tmp" || return
  # off a CUDA GPU kernel_bench runs only its interpret-mode smoke check and writes no rows
  [ -f "$OUT/kernel.json.tmp" ] || echo '{"rows": [], "note": "not a CUDA GPU: interpret-mode smoke check only (kernel.log)"}' \
    > "$OUT/kernel.json.tmp"
}

smollm2() {  # command buffers on | off
  local flags="" split=true
  [ "$1" = off ] && flags="--xla_gpu_enable_command_buffer=" && split=false
  [ "${DRY_RUN:-0}" = "1" ] && split=false  # the split's twelve programs say nothing at tiny shapes
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" $PY -m launch.decode_cost --models= --measure --measure_model "$SMALL" \
    --measure_split=$split "${MEAS[@]}" --out "$OUT/smollm2_command_buffers_$1.json.tmp"
}

train() {  # head rows flash name
  $PY -m launch.train --config "configs/$1.py" --workdir "$OUT/$4" --compile_only \
    --time_steps=3 --config.model.source=abstract "${TRAIN[@]}" --config.data.max_length="$2" \
    --config.data.global_batch_size=1 --config.train.mesh.data=1 --config.train.progress_bar=False \
    --config.model.flash_impl="$3" > "$OUT/$4.json.tmp"
}

train_rows() {
  for head in eagle3 confu; do
    for flash in ${FLASH//,/ }; do
      name="train_${head}_$1"
      [ "$flash" = xla ] || name="${name}_$flash"
      stage "$name" train "$head" "$1" "$flash" "$name"
    done
  done
}

if [ "${1:-}" = __run ]; then  # one stage's command, started by stage()
  shift
  "$@"
  exit
fi

stage kernel kernel                                                       # (i)
if [ "$MEASURE" = "1" ]; then
  stage smollm2_command_buffers_on smollm2 on                             # (iii)
  stage smollm2_command_buffers_off smollm2 off
  stage decode_8b $PY -m launch.decode_cost --models= --measure --measure_model "$BIG" \
    --measure_dtype model --draft_vocab "$BIG_VOCAB" --measure_split=false "${MEAS[@]}" \
    --out "$OUT/decode_8b.json.tmp"                                       # (v)
fi
rows=(${ROWS//,/ })
train_rows "${rows[0]}"                                                   # (iv), the first row length
stage decode_cost $PY -m launch.decode_cost "${DC[@]}" --out "$OUT/decode_cost.json.tmp"   # (ii)
for r in "${rows[@]:1}"; do train_rows "$r"; done
log "done: $OUT ($FAILED failed)"
[ "$FAILED" = 0 ]
