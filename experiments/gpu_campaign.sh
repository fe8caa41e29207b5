#!/usr/bin/env bash
# The GPU campaign, one call of the device tool: every call runs this same
# script; it resumes from .gpu_campaign/ (the working-tree copy the warm machine keeps) and stops
# before the call's 10 minutes are up. Calls, carried folders and what comes back:
# experiments/GPU_CAMPAIGN.md. Here, first: python -m experiments.gpu_campaign bundle
#
#   bash experiments/gpu_campaign.sh                      # on the GPU machine ($OUT set by the tool)
#   CAMPAIGN_E3_STEPS=300 CAMPAIGN_PLUS_STEPS=300 bash experiments/gpu_campaign.sh   # any Scale field
#   CAMPAIGN_SCALE=tiny bash experiments/gpu_campaign.sh  # the CPU dry run's scale (tests/e2e/test_gpu_campaign.py)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
exec "$PY" -m experiments.gpu_campaign run --out "${OUT:-$PWD/.gpu_campaign/out}" "$@"
