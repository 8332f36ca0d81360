#!/usr/bin/env bash
# The project's checks, as CI runs them: lint, format, types, then the tests (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
