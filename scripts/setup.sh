#!/usr/bin/env bash
# Create .venv and install longattn with its test and plot extras, from package registries only.
# torch 2.13.0 is installed first and pinned: it is the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,plot]"
# xformers (the optional GPU back end) without its dependencies: its wheel pins another torch build. On CPU its
# package still imports and its attention-bias objects work, so the tests of the xformers mapping run in CI.
python -m pip install --quiet --no-deps "xformers==0.0.35"
# triton (the optional "triton" back end), pinned: the suite runs its kernels on CPU through Triton's interpreter
# (tests/test_triton_band.py); a GPU brings its own triton with its torch build.
python -m pip install --quiet "triton==3.9.0"
