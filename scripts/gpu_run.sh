#!/usr/bin/env bash
# One prepared GPU run (scripts/gpu_run.py): environment, GPU tests, the targets' table at 64K tokens, one training
# step per recipe config against CPU; at most 7 minutes, each part with its own limit, results in OUT/results.jsonl.
#   bash scripts/gpu_run.sh --out runs/gpu_run        # then: python scripts/gpu_run.py --to-doc runs/gpu_run/results.jsonl
# Installs nothing. Runs the Python that holds torch (PYTHON, else python3, else python) on this checkout
# (PYTHONPATH), with Triton's kernels compiled (TRITON_INTERPRET=0). `timeout` is a backstop only: the script keeps
# to its own limits and writes its report before them.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
exec timeout --kill-after=10 "${GPU_RUN_BACKSTOP:-450}" "$PYTHON" scripts/gpu_run.py "$@"
