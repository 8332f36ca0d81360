#!/usr/bin/env bash
# The project's checks, as CI runs them: lint, format, types, then the tests (arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The tests in TEST_PROCESSES processes (default 2; 0: this one), a file's tests kept together so that its fixtures
# are built once (pytest-xdist, of the dev extra; without it, in this process): most tests run on one thread, so
# two processes keep a 2-core machine busy. Files go out in collection order, the longest first (tests/conftest.py,
# LONGEST_FILES), not xdist's order by number of tests, which started a one-test file of minutes last.
parallel=()
if .venv/bin/python -c "import xdist" 2> /dev/null; then parallel=(-n "${TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder); fi
.venv/bin/python -m pytest "${parallel[@]}" "$@"
