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
.venv/bin/python -m pip install -q -e ".[dev,recipes,export,serve,hf]"
# Chromium for the explorer's browser test (tests/test_explorer_browser.py), best effort and quiet: only as root
# with apt-get (Debian's chromium and chromium-driver, about 80 s once), never failing the setup; without it that
# test is skipped ("no Chromium"). SEQ2SEQ_NO_BROWSER=1 leaves it out.
if [ -z "${SEQ2SEQ_NO_BROWSER:-}" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
  && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Chromium for the browser test (apt-get)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null 2>&1 || echo "setup: Chromium could not be installed; the browser test will be skipped" >&2
fi
