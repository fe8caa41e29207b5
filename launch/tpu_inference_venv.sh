#!/usr/bin/env bash
# tpu-inference 0.32.0 (vLLM on TPU, JAX) in its own Python 3.12 virtual environment (default .venv-tpu-inference,
# or $CONFU_JAX_TPU_INFERENCE_VENV):
#     bash launch/tpu_inference_venv.sh
# tests/e2e/test_tpu_inference.py (marker `engine`) runs tpu-inference's own EAGLE-3 model and weight loader from
# there on what `launch.export_head --format tpu_inference` writes. Pinned, installed without dependency
# resolution from requirements-tpu-inference.txt (~9 GB; about 3 minutes from a local mirror). jax 0.11.2, which
# tpu-inference pins, needs Python 3.12: the first python3.12 found (PATH, then pyenv's versions) makes the venv.
# docs/interop.md "TPU: tpu-inference".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CONFU_JAX_TPU_INFERENCE_VENV:-.venv-tpu-inference}"
check='import sys, tpu_inference, jax; sys.exit(jax.__version__ != "0.11.2")'
if [ -x "$VENV/bin/python" ] && JAX_PLATFORMS=cpu "$VENV/bin/python" -c "$check" 2>/dev/null; then
    echo "tpu-inference already in $VENV"; exit 0
fi
PY=""
PYENV_ROOT_DIR="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
for candidate in "${CONFU_JAX_PYTHON312:-}" python3.12 "$PYENV_ROOT_DIR"/versions/3.12*/bin/python3.12 \
                 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
        PY="$candidate"; break
    fi
done
if [ -z "$PY" ]; then
    echo "tpu_inference_venv.sh: no Python 3.12 found (tpu-inference 0.32 pins jax 0.11.2, which needs 3.12): install" \
         "it (e.g. pyenv install 3.12, or apt install python3.12-venv) or set CONFU_JAX_PYTHON312=/path/to/python3.12" >&2
    exit 1
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q --no-deps -r requirements-tpu-inference.txt
JAX_PLATFORMS=cpu "$VENV/bin/python" -c "import tpu_inference, jax; print('tpu-inference on jax', jax.__version__, 'in $VENV')" 2>/dev/null
