#!/usr/bin/env bash
# Create the virtual environment and install the project with its test extras.
# torch is installed first, pinned to the CPU build: a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build. On a GPU machine set TORCH_SPEC.
set -euo pipefail
VENV=${1:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=69" wheel ninja
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
# --no-build-isolation: setup.py compiles the CPU kernels (every ISA variant) against the torch just installed
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]"
touch "$VENV/.installed"
