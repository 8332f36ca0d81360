#!/usr/bin/env bash
# Create .venv and install seq2seq with its test, recipe and serving extras.
# torch is installed first, pinned to the tested CPU release when none is present
# (set TORCH_SPEC to choose another, e.g. TORCH_SPEC="torch==2.13.0" or a CUDA build),
# so that the package's torch range never pulls a different multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[dev,recipes,export,serve]"
