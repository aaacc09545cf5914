#!/usr/bin/env bash
# The test suite (what CI runs): every test that needs no GPU, on 2 workers. GPU-only tests skip
# themselves without a GPU; CuTe DSL kernels are compiled for sm_90a / sm_100a here without one.
#   bash scripts/test.sh -m "not compile"    # without the CuTe DSL compiles
#   bash scripts/test.sh -m "not slow"       # without the longest end-to-end runs
#   bash scripts/test.sh tests/flax          # one area (folders: tests/README.md)
# On a CUDA GPU, the GPU tests alone (kernels built beforehand: tests/README.md):
#   .venv/bin/python -m pytest -m gpu tests
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
