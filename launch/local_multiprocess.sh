#!/usr/bin/env bash
# Multi-process training on ONE machine: N processes joined through a coordinator on 127.0.0.1.
# Useful to rehearse a multi-host run (sharding across processes, per-process data shards and
# checkpoint files) before paying for a cluster.
#
#   launch/local_multiprocess.sh [NUM_PROCS] -- --config configs/tiny.py --workdir runs/mp [--config.x=y ...]
#   launch/local_multiprocess.sh 2 -- --config configs/eagle3.py --workdir runs/mp \
#       --config.model.source=/path/to/checkpoint --config.data.train_files=data/train.jsonl
#
# Environment:
#   CPU_DEVICES=2   CPU devices per process (jax_num_cpu_devices; collectives over gloo). Set
#                   CPU_DEVICES=0 on a multi-GPU box and give each process its GPU(s) with
#                   LOCAL_DEVICE_IDS_<i>="0,1" (process i) instead.
#   PORT=12355      coordinator port.
set -euo pipefail
cd "$(dirname "$0")/.."

NUM_PROCS=2
if [[ $# -gt 0 && "$1" != "--" ]]; then NUM_PROCS="$1"; shift; fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
CPU_DEVICES="${CPU_DEVICES:-2}"
PORT="${PORT:-12355}"
PY="${PYTHON:-python}"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM

for ((i = 0; i < NUM_PROCS; i++)); do
  extra=()
  if [[ "$CPU_DEVICES" != "0" ]]; then extra+=(--cpu_devices="$CPU_DEVICES"); fi
  ids_var="LOCAL_DEVICE_IDS_$i"
  if [[ -n "${!ids_var:-}" ]]; then extra+=(--local_device_ids="${!ids_var}"); fi
  XLA_FLAGS="${XLA_FLAGS:-}" "$PY" -m launch.train \
    --coordinator_address="127.0.0.1:$PORT" --num_processes="$NUM_PROCS" --process_id="$i" \
    "${extra[@]}" "$@" &
  pids+=("$!")
done

status=0
for p in "${pids[@]}"; do
  if ! wait "$p"; then status=1; cleanup; fi
done
exit "$status"
