#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with jaxflash (editable) and everything
# its tests, examples, benchmarks and the CuTe DSL compiler need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# jax[cpu] here: CI and development machines have no GPU. On a GPU machine install jax[cuda13]
# instead (the CuTe DSL kernels need only the small runtime library there).
.venv/bin/python -m pip install -q "jax[cpu]>=0.10.2" -e ".[test,cute,flax,bench]"
.venv/bin/python -c "import jax, jaxflash; print('jaxflash', jaxflash.__version__, 'jax', jax.__version__, jax.default_backend())"
