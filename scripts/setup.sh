#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with jaxflash (editable) and everything
# its tests, examples, benchmarks and the CuTe DSL compiler need. Idempotent.
#   PYTHON=python3.12 bash scripts/setup.sh   # another interpreter: the newest jax it allows
# jax[cpu] here: CI and development machines have no GPU. On a GPU machine see the README
# ("Install for a CUDA GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "" 2>/dev/null && command -v pyenv >/dev/null 2>&1; then
  # A pyenv shim answers only for the selected versions: select the one PY names.
  ver=$(pyenv versions --bare | grep -E "^${PY#python}(\.|$)" | tail -n 1 || true)
  [ -n "$ver" ] && export PYENV_VERSION=$ver
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "jax[cpu]>=0.10.2" -e ".[test,cute,flax,bench]"
.venv/bin/python -c "import sys, jax, jaxflash; print('jaxflash', jaxflash.__version__, 'jax', jax.__version__, jax.default_backend(), 'python', sys.version.split()[0])"
