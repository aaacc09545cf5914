#!/usr/bin/env bash
# Here (CuTe DSL installed, no GPU): everything a GPU session carries, in .device/ and artifacts/
# (both git-ignored; about 20 MB, under the 64 MiB a device call may upload):
#   .device/libcute_dsl_runtime.so.xz + unpack.sh   the DSL runtime (../shared/device/pack_runtime.sh)
#   .device/kernels/   forward and backward variants of devrun / bwd_devrun (checks, bench grid,
#                      variants) and of the example LM's GPU run
#   artifacts/ffi_selftest/   the bridge self-test kernels and exports (tests/test_ffi_gpu.py)
# Then one call: run(command="bash benchmarks/device/run.sh tests gridcc", carry=[".device", "artifacts"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD
bash ../shared/device/pack_runtime.sh .device "$PY"
# the commit the artifacts are built from: results files name it (benchmarks/envinfo.py)
echo "$(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- jaxflash || echo -dirty)" > .device/COMMIT
# STAGES=quick: only what the GPU tests and the grids reach (no harness checks, no LM)
"$PY" -m devtools.ptx_digest --build .device/kernels
if [ "${STAGES:-all}" = all ]; then
"$PY" -m devtools.devrun build --out .device/kernels
"$PY" -m devtools.bwd_devrun build --out .device/kernels
"$PY" -m examples.lm.build_kernels --out .device/kernels --size full --batch 16 --mesh 1,1
fi
# FP8=1: the FP8 forward variants of run.sh's fp8 stage (benchmarks.fp8_bench build, ~10 min)
if [ "${FP8:-0}" = 1 ]; then
"$PY" -m benchmarks.fp8_bench build --out .device/kernels
fi
# FP8BWD=1: the FP8 backward variants of run.sh's fp8bwd stage (its GPU test's cases and the
# fwd+bwd bench points, hd 64, 128 and 256: benchmarks.fp8_bench build --bwd, ~3 min)
if [ "${FP8BWD:-0}" = 1 ]; then
"$PY" -m benchmarks.fp8_bench build --bwd --out .device/kernels
fi
# BLACKWELL=1: the sm_100a variants the first-run kit dispatches to (run.sh's blackwell stage,
# for a B200 / GB200 machine without the DSL; ~3 min)
if [ "${BLACKWELL:-0}" = 1 ]; then
"$PY" -m devtools.blackwell_first_run build --out .device/kernels
fi
"$PY" -m devtools.gpu_selftest artifacts/ffi_selftest
# one kernel directory for the whole GPU test run
cp -r artifacts/ffi_selftest/kernels/. .device/kernels/
# whatever the GPU tests reach through dispatch (recorded by running them once here)
"$PY" -m tests.collect_variants --out .device/kernels -m gpu tests | tail -3
# the extremes' programs are too large to run here: traced only
JAXFLASH_PLATFORM=cuda "$PY" -m tests.collect_variants --out .device/kernels \
  --lower tests.extremes.test_large_gpu:lower_cute_programs | tail -2
du -sh .device artifacts
