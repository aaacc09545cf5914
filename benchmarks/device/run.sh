#!/usr/bin/env bash
# The GPU runbook. On the H200 (no CuTe DSL there; jax 0.11.2), after
# `bash benchmarks/device/prepare.sh` here:
#   run(command="bash benchmarks/device/run.sh STAGE...", carry=[".device", "artifacts"])
# STAGE:
#   tests     the GPU test suite: `pytest -m gpu tests` (kernels against float64, the API
#             through jax.grad on every backend, the FFI bridge, cudnn)           (~6 min)
#   checks    the kernels' float64 check cases (forward, backward, determinism) through the
#             device harnesses, with cuDNN's error beside ours                     (~6 min)
#   sanitize  compute-sanitizer memcheck + racecheck on small backward cases         (~5 min)
#   gridcc    the anchor grid, ours and cuDNN only                                (~2.5 min)
#   grid      the anchor grid, every implementation (a call of its own)            (~9 min)
#   kbench    kernel-level forward and backward timings beside cuDNN               (~4 min)
#   lm        examples.lm.compare: cute against xla, 400 steps                     (~4 min)
#   extremes  tensors past 2^31 elements, B past the grid limit, one 2^20-token causal
#             sequence forward+backward (tests/extremes/test_large_gpu.py; time and peak
#             memory by benchmarks.long_context)                                  (~6 min)
#   fp8       the Hopper FP8 forward against its emulated contract and float64
#             (tests/kernels/test_fp8_gpu.py), then ours FP8 / ours bf16 / cuDNN FP8 over the
#             grid (benchmarks.fp8_bench; FP8_QUICK=1: D 128/256 x S 4k/16k; FP8_TILES=1 adds
#             the FP8 variants' comparison, +2.5 min; needs `fp8_bench build` in prepare)  (~4 min)
#   fp8bwd    the Hopper FP8 backward kernel against its emulated contract and float64
#             (tests/kernels/test_fp8_bwd_gpu.py; FP8BWD_K selects cases, e.g. d256), then FP8
#             fwd+bwd vs our bf16 vs cuDNN FP8 at D 128, vs our bf16 at D 64 / 256
#             (benchmarks.fp8_bench run --bwd; FP8BWD_DIMS=128 for one head dim: all of them
#             take more than one call; needs `fp8_bench build --bwd` in prepare); FP8BWD_SAN=1
#             adds memcheck + racecheck on one small case (FP8BWD_SAN_K picks it, e.g.
#             d256-small)                                               (~2 + 5 min a dim)
#   ncufp8    Nsight Compute (full set) of attention kernels at 4k dense, NCU_POINTS of D:what,
#             what = fp8 / bf16 (our backward kernel), fp8fwd / bf16fwd (our forward kernel),
#             cudnnfwd / cudnnbwd (cuDNN's FP8 kernels); default 64:fp8 128:fp8 64:bf16: pipes,
#             stall reasons, instruction counts (benchmarks.kernel_profile --ncu)   (~1 min each)
#   prologue  precision="fp8"'s prologue on the GPU: the Triton kernel and the XLA arrangement
#             bit for bit against the rules (tests/fp8/test_prologue_gpu.py, xdist workers
#             carried in .device/pylib), then benchmarks.fp8_prologue_bench (PROLOGUE_SWEEP=1:
#             with the tilings' sweep, whose compiles take minutes)               (~5 min)
#   mods      score / mask mods in the CuTe kernels and the Triton-compiled Pallas kernels
#             against the float32 reference (tests/kernels/test_mods_gpu.py,
#             tests/mods/test_mods_gpu.py)                                        (~4 min)
#   mbench    the mods' speed: benchmarks.mods_kernel_bench (mod vs built-in, sparse vs dense;
#             MBENCH_CEILING=1 adds short dense loops vs 16k, ours and cuDNN's: needs
#             `mods_kernel_bench --build DIR --ceiling`) and benchmarks.mods_bench (cute / pallas
#             / cuDNN / xla on the issue's mods)
#   lmprec    examples LM with bf16 / FP8 / emulated FP4 attention, 400 steps each
#             (benchmarks.lm_precision), FP8 accuracy (benchmarks.fp8_accuracy)
#   blackwell the sm_100a first-run kit (devtools.blackwell_first_run): on a B200 / GB200 the
#             float64 checks, tests/kernels/test_sm100*_gpu.py, memcheck + racecheck, the grid
#             beside cuDNN (and FlashAttention-4 when installed) and verdict.json, which says
#             what to change in jaxflash/kernels/policy/verified.py; anywhere else (the H200)
#             it refuses at once: rc 2, verdict.json "not_blackwell"      (B200: ~25 min)
#   ring1m    (nvidia-h200-x2) the 2^20-token causal GQA 8:1 sequence by ring_attention over
#             two GPUs beside one GPU (benchmarks.ring_scaling)                    (~4 min)
# A variant not yet checked on a GPU is admitted here (JAXFLASH_CUTE_UNVERIFIED=1): these runs
# are what checks it; `gated` below runs a new feature's checks, sanitizers and bench at once.
# Results go to $OUT (the device tool returns a few files per call): copy them into
# benchmarks/results/ and index them in its README.
set -x
cd "$(dirname "$0")/../.."
export CUTE_DSL_RUNTIME_LIB=$(bash .device/unpack.sh)
export JAXFLASH_KERNEL_DIR=$PWD/.device/kernels JAXFLASH_CUTE_UNVERIFIED=1
D=$(date -u +%F)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# check_cases MODULE FILTER TAG: the float64 check cases of devtools.MODULE (devrun = forward,
# bwd_devrun = backward) whose config kwargs `kw` pass FILTER (a Python expression).
check_cases() {
  local mod=$1 filter=$2 tag=$3 side=${1%devrun} cases
  side=${side:-fwd-}; side=${side/bwd_/bwd-}
  cases=$(python3 -c "from devtools.$mod import CHECKS; print(';'.join(n for n, kw, _ in CHECKS if $filter))")
  timeout 150 python3 -m devtools.$mod check --cases "$cases" \
    --out $OUT/cute-${side}check-$tag-$D.json 2>&1 | grep -v -i warn | tail -12
}
# gated MODULE FILTER TAG SANITIZER_CASES POINTS [BENCH ARGS]: a gated feature's first GPU run:
# its float64 check cases, memcheck + racecheck on SANITIZER_CASES, a bench of POINTS.
gated() {
  local mod=$1 filter=$2 tag=$3 san=$4 points=$5; shift 5
  local side=${mod%devrun}; side=${side:-fwd-}; side=${side/bwd_/bwd-}
  check_cases "$mod" "$filter" "$tag"
  for tool in memcheck racecheck; do
    timeout 80 compute-sanitizer --tool $tool --print-limit 20 python3 -m devtools.$mod \
      check --cases "$san" --out $OUT/san-$tool.json > $OUT/cute-${side}$tag-$tool-$D.log 2>&1
    echo "$tool rc=$?"; tail -1 $OUT/cute-${side}$tag-$tool-$D.log
  done
  rm -f $OUT/san-*.json
  timeout 240 python3 -m devtools.$mod bench --only "$points" "$@" \
    --out $OUT/cute-${side}bench-$tag-$D.json 2>&1 | tail -12
}

for stage in "$@"; do case $stage in
tests)
  # XLA's GPU autotuning only picks speeds: off, it would triple the compile time of each test.
  # The tests' time is XLA compiling on the CPU: with pytest-xdist (carried in .device/pylib
  # when the machine lacks it) several workers share the GPU, none preallocating its memory.
  N=""; PYTHONPATH=$PWD/.device/pylib:${PYTHONPATH:-} python3 -c "import xdist" 2>/dev/null \
    && N="-n ${TESTS_N:-6}"
  PYTHONPATH=$PWD/.device/pylib:${PYTHONPATH:-} XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  JAXFLASH_FFI_EXPORT_DIR=$PWD/artifacts/ffi_selftest \
    timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -m gpu $N -rA -p no:cacheprovider tests ${TESTS_K:+-k "$TESTS_K"} \
    2>&1 | tee $OUT/gpu-tests-$D.log | grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed" | tail -80 ;;
checks)
  timeout 330 python3 -m devtools.bwd_devrun check --out $OUT/cute-bwd-check-$D.json 2>&1 | tail -30
  timeout 200 python3 -m devtools.devrun check --out $OUT/cute-fwd-check-$D.json 2>&1 | tail -30
  timeout 120 python3 -m devtools.bwd_devrun determinism --out $OUT/cute-bwd-determinism-$D.json 2>&1 | tail -8 ;;
sanitize)
  SAN=${SAN_CASES:-"bf16 h256 tiny;bf16 h192 causal T>S;bf16 h64 alibi odd;bf16 h128 segments"}
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-280} compute-sanitizer --tool $tool --print-limit 20 python3 -m devtools.bwd_devrun \
      check --cases "$SAN" --out $OUT/san-$tool.json > $OUT/cute-bwd-$tool-$D.log 2>&1
    tail -3 $OUT/cute-bwd-$tool-$D.log
  done
  rm -f $OUT/san-*.json ;;
gridcc)
  timeout ${GRID_TIMEOUT:-300} python3 -m benchmarks.bench --out $OUT --name h200-$D-cc --impl cute,cudnn \
    --budget-s $(( ${GRID_TIMEOUT:-300} - 60 )) --stall-s 100 2>&1 | tail -40 ;;
grid)
  timeout 585 python3 -m benchmarks.bench --out $OUT --name h200-$D --budget-s 530 --stall-s 120 2>&1 | tail -40 ;;
kbench)
  timeout 200 python3 -m devtools.devrun bench --out $OUT/cute-fwd-bench-$D.json 2>&1 | tail -25
  timeout 240 python3 -m devtools.bwd_devrun bench --out $OUT/cute-bwd-bench-$D.json 2>&1 | tail -25 ;;
lm)
  # LM_BASELINES=1 (one xla run instead of two) fits a call into ~4 min of device time
  timeout 330 python3 -m examples.lm.compare --out $OUT/lm --baseline-runs ${LM_BASELINES:-2} \
    --candidate cute --size full --steps 400 --batch 16 --mesh 1,1 2>&1 | grep -v "^step" | tail -12 ;;
extremes)
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    timeout ${EXTREMES_TIMEOUT:-420} python3 -m pytest -m gpu -rA -s \
    -p no:cacheprovider tests/extremes/test_large_gpu.py tests/extremes/test_bad_values_gpu.py \
    ${EXTREMES_K:+-k "$EXTREMES_K"} 2>&1 \
    | tee $OUT/gpu-extremes-$D.log | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^d|^cute|^pallas|\{" | tail -30
  [ "${EXTREMES_LONG:-1}" = 1 ] && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m benchmarks.long_context --s 1048576 \
    --heads 8 --kv-heads 1 --causal 1 --reps 1 --impl cute --out $OUT/long-context-1m-h200-$D.json \
    2>&1 | grep -v -i warn | tail -25 ;;
fp8)
  PYTHONPATH=$PWD/.device/pylib:${PYTHONPATH:-} timeout ${FP8_TEST_TIMEOUT:-200} python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rA tests/kernels/test_fp8_gpu.py -s \
    2>&1 | tee $OUT/gpu-fp8-tests-$D.log | grep -v -i warn | tail -25
  timeout ${FP8_BENCH_TIMEOUT:-150} python3 -m benchmarks.fp8_bench run ${FP8_QUICK:+--quick} --out $OUT \
    2>&1 | grep -v -i warn | tail -45
  # FP8_TILES=1: the FP8 variants compared (key tiles, persistent loop, 192 rows at hd 64,
  # conditional rescale)
  [ "${FP8_TILES:-0}" = 1 ] && timeout ${FP8_TILES_TIMEOUT:-240} python3 -m benchmarks.fp8_bench run --tiles --out $OUT \
    2>&1 | grep -v -i warn | tail -14 ;;
fp8bwd)
  # (4 workers share the GPU)
  PYTHONPATH=$PWD/.device/pylib:${PYTHONPATH:-} XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  timeout ${FP8BWD_TEST_TIMEOUT:-240} python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rA -s \
    tests/kernels/test_fp8_bwd_gpu.py ${FP8BWD_K:+-k "$FP8BWD_K"} 2>&1 \
    | tee $OUT/gpu-fp8-bwd-tests-$D.log | grep -E "rel-L2|PASSED|FAILED|ERROR|passed|failed|Error" | tail -30
  [ "${FP8BWD_BENCH:-1}" = 1 ] && timeout ${FP8BWD_BENCH_TIMEOUT:-330} python3 -m benchmarks.fp8_bench \
    run --bwd ${FP8BWD_DIMS:+--dims $FP8BWD_DIMS} --out $OUT 2>&1 | grep -v -i warn | tail -18
  if [ "${FP8BWD_SAN:-0}" = 1 ]; then
    for tool in memcheck racecheck; do
      timeout 90 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -m gpu \
        -p no:cacheprovider tests/kernels/test_fp8_bwd_gpu.py -k ${FP8BWD_SAN_K:-d64-tensor-scales} \
        > $OUT/gpu-fp8-bwd-$tool-$D.log 2>&1
      echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" $OUT/gpu-fp8-bwd-$tool-$D.log | tail -2
    done
  fi ;;
ncufp8)
  for pt in ${NCU_POINTS:-64:fp8 128:fp8 64:bf16}; do
    d=${pt%%:*}; c=${pt#*:}; n=1
    case $c in
      fp8) call="FP8 inputs, forward + backward"; k="cutlass_kernel_.*FlashBwd" ;;
      bf16) call="bf16, forward + backward"; k="cutlass_kernel_.*FlashBwd" ;;
      fp8fwd) call="FP8 inputs, forward"; k="cutlass_kernel_.*FlashFwd" ;;
      bf16fwd) call="bf16, forward"; k="cutlass_kernel_.*FlashFwd" ;;
      cudnnfwd) call="cuDNN FP8, forward"; k="sdpa|fmha|flash|fprop|attn" ;;
      cudnnbwd) call="cuDNN FP8, forward + backward"; k="sdpa|fmha|flash|prop|attn"; n=3 ;;
      *) echo "ncufp8: unknown $c"; continue ;;
    esac
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 10 ${NCU_TIMEOUT:-150} \
      ncu --clock-control none --set full --print-details all \
      --kernel-name regex:"$k" --launch-count $n \
      python3 -m benchmarks.kernel_profile --d $d --s 4096 --ncu --calls "$call" \
      > $OUT/ncu-$c-h$d-4k-$D.txt 2>&1
    echo "ncu $pt rc=$?"
    grep -E "^  [a-zA-Z_].*\(|Duration|Executed Instructions  |Issue Slots|Warp Cycles Per Issued|Pipe (Xu|Alu|Fma|Tensor) |Registers Per" \
      $OUT/ncu-$c-h$d-4k-$D.txt | sort -u | cut -c1-120 | head -40
  done ;;
prologue)
  PYTHONPATH=$PWD/.device/pylib:${PYTHONPATH:-} XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout ${PROLOGUE_TEST_TIMEOUT:-400} \
    python3 -m pytest -m gpu -n 8 -rA -s -p no:cacheprovider -p no:benchmark --tb=short \
    tests/fp8/test_prologue_gpu.py 2>&1 | tee $OUT/gpu-prologue-tests-$D.log \
    | grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed|differ" | cut -c1-600 | tail -40
  # PROLOGUE_SWEEP=1 adds the tilings' sweep at 4k (their Triton compiles take minutes)
  timeout ${PROLOGUE_BENCH_TIMEOUT:-180} python3 -m benchmarks.fp8_prologue_bench run \
    $([ "${PROLOGUE_SWEEP:-0}" = 1 ] || echo --no-sweep) --out $OUT 2>&1 | grep -v -i warn | tail -30 ;;
mods)
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    timeout ${MODS_TIMEOUT:-280} python3 -m pytest -m gpu -rA -p no:cacheprovider \
    tests/kernels/test_mods_gpu.py tests/mods/test_mods_gpu.py 2>&1 | tee $OUT/gpu-mods-tests-$D.log \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" | tail -40 ;;
mbench)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 250 python3 -m benchmarks.mods_kernel_bench \
    --out $OUT/mods-kernel-bench-h200-$D.json 2>&1 | grep -v -i warn | tail -20
  # MBENCH_CEILING=1: short dense loops against 16k, ours and cuDNN's (what a sparse row's
  # few tiles can reach)
  [ "${MBENCH_CEILING:-0}" = 1 ] && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 \
    python3 -m benchmarks.mods_kernel_bench --ceiling \
    --out $OUT/mods-ceiling-h200-$D.json 2>&1 | grep -v -i warn | tail -6
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m benchmarks.mods_bench --out $OUT \
    --budget-s 150 2>&1 | grep -v -i warn | tail -20 ;;
lmprec)
  timeout ${LM_TIMEOUT:-280} python3 -m benchmarks.lm_precision --out $OUT --budget-s ${LM_BUDGET:-150} \
    2>&1 | grep -v -i warn | tail -30
  timeout ${ACC_TIMEOUT:-120} python3 -m benchmarks.fp8_accuracy --out $OUT 2>&1 | grep -v -i warn | tail -20 ;;
blackwell)
  # BW_SKIP: steps to leave out (checks,tests,sanitizers,grid), to fit a device call's limit
  timeout ${BW_TIMEOUT:-590} python3 -m devtools.blackwell_first_run --out $OUT/blackwell-first-run-$D \
    ${BW_SKIP:+--skip $BW_SKIP} 2>&1 | grep -v -i warn | tail -40
  echo "blackwell first-run kit rc=${PIPESTATUS[0]}" ;;
ring1m)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m benchmarks.ring_scaling --s 1048576 \
    --heads 8 --kv-heads 1 --impl cute --reps 1 --out $OUT/ring-1m-h200x2-$D.json 2>&1 \
    | grep -v -i warn | tail -20 ;;
*) echo "unknown stage $stage" ;;
esac; done
