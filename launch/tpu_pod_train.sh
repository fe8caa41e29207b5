#!/usr/bin/env bash
# Training on a Cloud TPU VM pod slice: the same command on every worker; JAX's TPU cluster
# detection (jax.distributed.initialize() with no arguments) connects the workers.
#
#   TPU_NAME=... ZONE=... launch/tpu_pod_train.sh CONFIG WORKDIR MODEL DATA [--config.x=y ...]
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a launch/tpu_pod_train.sh configs/confu.py /mnt/shared/runs/confu8b \
#       /mnt/shared/Qwen3-8B /mnt/shared/data/train.jsonl --config.train.mesh.fsdp=4
#
# MODEL / DATA as in launch/slurm_train.sbatch ('-' keeps the config's). The global batch defaults to
# 16 rounded up to a multiple of the data-parallel chips (32 on a 32-chip slice).
# Assumes the repository and its .venv (requirements.txt plus jax[tpu]) at $REMOTE_DIR on every
# worker, and a run directory every worker can see (NFS / Filestore / gcsfuse mount).
# Maintenance events and preemption: Cloud TPU sends the training process SIGTERM (and waits up to
# 5 minutes for it to exit) only on a TPU created for it, with Autocheckpoint:
#   gcloud alpha compute tpus tpu-vm create $TPU_NAME ... --autocheckpoint-enabled
# (a queued resource takes the same flag). Then the run saves at an agreed step and a re-run of this
# script resumes it. Without that flag no signal comes and the maintenance stops the VMs at once: the
# run loses what it trained since its last save, which checkpoint.every (steps) and
# checkpoint.every_seconds (default 1800 s) bound; a re-run resumes from that save.
set -euo pipefail

USAGE="usage: TPU_NAME=... ZONE=... launch/tpu_pod_train.sh CONFIG WORKDIR MODEL DATA [--config.x=y ...]"
CONFIG="${1:?$USAGE}"
WORKDIR="${2:?$USAGE}"
MODEL="${3:?$USAGE}"
DATA="${4:?$USAGE}"
shift 4
[[ "$DATA" != "-" ]] && set -- --config.data.train_files="$DATA" "$@"
[[ "$MODEL" != "-" ]] && set -- --config.model.source="$MODEL" "$@"
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REMOTE_DIR="${REMOTE_DIR:-~/confu_jax}"
PROJECT_FLAG=()
[[ -n "${PROJECT:-}" ]] && PROJECT_FLAG=(--project "$PROJECT")

quoted_args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REMOTE_DIR && . .venv/bin/activate && python -m launch.train --config $(printf %q "$CONFIG") --workdir $(printf %q "$WORKDIR")$quoted_args"
