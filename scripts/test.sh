#!/usr/bin/env bash
# The test suite (what CI runs). GPU-only tests skip themselves without a GPU; CuTe DSL kernels
# are compiled for sm_90a / sm_100a here without one.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
