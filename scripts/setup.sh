#!/usr/bin/env bash
# Create .venv (if missing) and install asyncrl with its test extras.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build that this
# kind of machine ships as a local file (torch==2.13.0); GPU machines get whatever
# torch the resolver picks within pyproject's range. Override with ASYNCRL_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip, minus this kind of machine's noise about local index folders it does not have
pip_install() { python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${ASYNCRL_TORCH_SPEC:-}" ]; then
    pip_install "$ASYNCRL_TORCH_SPEC"
  elif ! command -v nvidia-smi >/dev/null 2>&1; then
    pip_install "torch==2.13.0"
  fi
fi
pip_install -e ".[test]"
