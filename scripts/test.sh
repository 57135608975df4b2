#!/usr/bin/env bash
# Set up (.venv, installs) and run the test suite. Extra arguments go to pytest.
# The suite runs in PYTEST_WORKERS processes (pytest-xdist; default 2, one per core of the CI machine), each with one
# intra-op thread: the tests' tensors are small, so two single-threaded workers finish in well under half the time of
# one process whose two threads fight over every small op.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Lint and format check first (seconds): a style slip fails fast, before the long pytest run.
ruff check .
ruff format --check .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --durations: the log names the slowest tests, so a run that grows slower shows where.
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 "$@"
