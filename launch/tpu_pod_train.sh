#!/usr/bin/env bash
# Training on a Cloud TPU VM pod slice: the same command on every worker; JAX's TPU cluster
# detection (jax.distributed.initialize() with no arguments) connects the workers.
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a launch/tpu_pod_train.sh configs/llama31_8b_confu.py \
#       /mnt/shared/runs/confu8b [--config.x=y ...]
#
# Assumes the repository and its .venv (requirements.txt plus jax[tpu]) at $REMOTE_DIR on every
# worker, and a run directory every worker can see (NFS / Filestore / gcsfuse mount). Spot /
# preemptible slices: TPU maintenance events send SIGTERM; the run checkpoints at an agreed step
# and a re-run of this script resumes it.
set -euo pipefail

CONFIG="${1:?usage: TPU_NAME=... ZONE=... launch/tpu_pod_train.sh CONFIG WORKDIR [--config.x=y ...]}"
WORKDIR="${2:?usage: TPU_NAME=... ZONE=... launch/tpu_pod_train.sh CONFIG WORKDIR [--config.x=y ...]}"
shift 2
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REMOTE_DIR="${REMOTE_DIR:-~/confu_jax}"
PROJECT_FLAG=()
[[ -n "${PROJECT:-}" ]] && PROJECT_FLAG=(--project "$PROJECT")

quoted_args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${PROJECT_FLAG[@]}" --worker=all \
  --command "cd $REMOTE_DIR && . .venv/bin/activate && python -m launch.train --config $(printf %q "$CONFIG") --workdir $(printf %q "$WORKDIR")$quoted_args"
