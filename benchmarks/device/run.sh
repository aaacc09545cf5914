#!/usr/bin/env bash
# On the H200 (no DSL; jax 0.11.2): run.sh STAGE... with STAGE in
#   checks  forward and backward kernels against float64 (+ cuDNN's error), bwd determinism,
#           the bridge's GPU tests  (~6 min with the 16 tile_m 128 cases: a call of its own)
#   api     the shared backend test base (tests/test_backends.py) for "cute" and the forward's
#           API tests, through jax.grad / custom_vjp on the GPU          (~6 min?, see below)
#   lm      examples.lm.compare: cute vs two xla runs, 400 steps          (~4 min)
# Measured 2026-12-01: "checks lm" 510 s in one call (53 bwd cases then; 69 now); "grid" 443 s; bwd kbench 92 s, fwd 42 s;
# sanitize with 3 cases ~40 s.
#   grid    the anchor grid, every implementation, fwd and fwd+bwd  (~9 min: a call of its own)
#   gridcc  the same grid, ours and cuDNN only                        (~2.5 min)
#   kbench  kernel-level fwd and bwd timings beside cuDNN                (~4 min)
#   sanitize  compute-sanitizer memcheck + racecheck, small new backward cases (~5 min)
#   pairs   tile_order "pairs" (cleared and picked 2026-12-01): its forward check cases, the
#           sanitizers on two, the pick against the pick with pairs at causal points  (~2.5 min)
#   c2check the c2 check cases alone
#   s3      three K / V stages on the dense persistent picks: checks, sanitizers, bench (~3 min)
#   msk     FwdConfig.mask_skip (gated): checks, sanitizers, dense picks with / without (~3 min)
#   msk2    mask_skip: the dense picks with / without it at every dense point, twice (~4 min)
#   sel     FwdConfig.mask_select (gated): checks, sanitizers, causal picks with / without (~3 min)
#   selcheck mask_select's check cases alone (incl. hd 192's, not yet run)  (~1.5 min)
#   sel2    mask_select's second bench                                          (~1.5 min)
#   featsel masked calls off the grid (windows, key lengths): dispatched / default schedule /
#           mask_select flipped, twice (~2 min)
#   featcheck the plain schedules' float64 cases with windows / key lengths (~1.5 min)
#   ncubwd  ncu (speed of light, memory tables, warp stalls, pipes) of our backward main kernel
#           at D=256 4k dense and D=128 4k dense: where the wide kernel's step time goes (~3 min)
#   qmc     backward q_multicast and do_first (cleared 2026-12-02; q_multicast picked at dense
#           hd 256 from 4k keys): checks, D=256 bench, sanitizers (~4 min)
#   qmc128  q_multicast at hd 128: bench only (~1.5 min)
#   dqwg    backward dq_wg_flush at hd 192 / 256 (cleared 2026-12-02, not picked): checks,
#           sanitizers, bench (~2 min)
#   m256    256-row tiles at hd 64 (cleared, picked 2026-12-02): checks, sanitizers, bench
#   occ     ncu launch stats / occupancy of our 1k forward and cuDNN's           (~2 min)
#   c2      64-row forward tiles at two CTAs per SM (cleared, picked at causal 1k): its check
#           cases, the sanitizers on two, the pick against the variants at 1k / 4k  (~5 min)
#   taillpt backward tail_lpt (cleared and picked 2026-12-01): its check cases, the sanitizers
#           on two, a bench of the causal points (*_tl beside the variants)         (~3 min)
# Results go to $OUT (few files: the device tool returns about 8 per call); copy them into
# benchmarks/results/ with the date. Variants not yet checked on a GPU are admitted here
# (JAXFLASH_CUTE_UNVERIFIED=1): these runs are what checks them.
set -x
cd "$(dirname "$0")/../.."
export CUTE_DSL_RUNTIME_LIB=$(bash .device/unpack.sh)
export JAXFLASH_KERNEL_DIR=$PWD/.device/kernels JAXFLASH_CUTE_UNVERIFIED=1
D=$(date -u +%F)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# check_cases MODULE FILTER TAG: the float64 check cases of MODULE (devrun = forward,
# bwd_devrun = backward) whose config kwargs `kw` pass FILTER (a Python expression).
check_cases() {
  local mod=$1 filter=$2 tag=$3 side=${1%devrun} cases
  side=${side:-fwd-}; side=${side/bwd_/bwd-}
  cases=$(python3 -c "from jaxflash.kernels.$mod import CHECKS; print(';'.join(n for n, kw, _ in CHECKS if $filter))")
  timeout 150 python3 -m jaxflash.kernels.$mod check --cases "$cases" \
    --out $OUT/cute-${side}check-$tag-$D.json 2>&1 | grep -v -i warn | tail -12
}
# A gated feature's first GPU run: gated MODULE FILTER TAG SANITIZER_CASES POINTS [BENCH ARGS]
# (MODULE devrun = forward, bwd_devrun = backward; FILTER a Python test on a check case's
# config kwargs `kw`): its float64 check cases, memcheck + racecheck on SANITIZER_CASES, and a
# bench of POINTS.
gated() {
  local mod=$1 filter=$2 tag=$3 san=$4 points=$5; shift 5
  local side=${mod%devrun}; side=${side:-fwd-}; side=${side/bwd_/bwd-}
  check_cases "$mod" "$filter" "$tag"
  for tool in memcheck racecheck; do
    timeout 80 compute-sanitizer --tool $tool --print-limit 20 python3 -m jaxflash.kernels.$mod \
      check --cases "$san" --out $OUT/san-$tool.json > $OUT/cute-${side}$tag-$tool-$D.log 2>&1
    echo "$tool rc=$?"; tail -1 $OUT/cute-${side}$tag-$tool-$D.log
  done
  rm -f $OUT/san-*.json
  timeout 240 python3 -m jaxflash.kernels.$mod bench --only "$points" "$@" \
    --out $OUT/cute-${side}bench-$tag-$D.json 2>&1 | tail -12
}

for stage in "$@"; do case $stage in
checks)
  # backward cases never yet run on a GPU first (NEW_RE, a regex over case names: none
  # pending since the dq_chunks cases ran, 2026-12-01 ~12:00 UTC), then the rest
  NEW_RE=${NEW_RE:-^$}
  NEW=$(python3 -c "import re; from devtools.bwd_devrun import CHECKS; print(';'.join(n for n, _, _ in CHECKS if re.search('$NEW_RE', n)))")
  [ -n "$NEW" ] && timeout 180 python3 -m devtools.bwd_devrun check --cases "$NEW" --out $OUT/cute-bwd-check-new-$D.json 2>&1 | tail -40
  OLD=$(python3 -c "import re; from devtools.bwd_devrun import CHECKS; print(';'.join(n for n, _, _ in CHECKS if not re.search('$NEW_RE', n)))")
  timeout 330 python3 -m devtools.bwd_devrun check --cases "$OLD" --out $OUT/cute-bwd-check-$D.json 2>&1 | tail -30
  timeout 200 python3 -m devtools.devrun check --out $OUT/cute-fwd-check-$D.json 2>&1 | tail -30
  timeout 120 python3 -m devtools.bwd_devrun determinism --out $OUT/cute-bwd-determinism-$D.json 2>&1 | tail -8
  JAXFLASH_KERNEL_DIR=$PWD/artifacts/ffi_selftest/kernels JAXFLASH_FFI_EXPORT_DIR=$PWD/artifacts/ffi_selftest \
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -4 ;;
api)
  # 2026-12-01: ~17 s per test (XLA compiles of the call, its grad and the reference's, with
  # GPU autotuning), 13 of 26 done in 230 s. Autotuning only picks speeds: off here.
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 480 python3 -m pytest -v \
    -p no:cacheprovider tests/test_backends.py tests/test_kernels_hopper_gpu.py -k "${API_K:-cute or hopper_gpu}" \
    2>&1 | tee $OUT/api-$D.log | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -40 ;;
lm)
  # LM_BASELINES=1 (one xla run instead of two) fits a call into ~4 min of device time
  timeout 330 python3 -m examples.lm.compare --out $OUT/lm --baseline-runs ${LM_BASELINES:-2} \
    --candidate cute --size full --steps 400 --batch 16 --mesh 1,1 2>&1 | grep -v "^step" | tail -12 ;;
pairs)
  # the persistent causal order built 2026-12-01 evening (NOTES.md "Persistent causal balance")
  gated devrun "kw.get('tile_order') == 'pairs'" pairs \
    "bf16 h128 pairs causal odd nm;fp16 h128 pairs window seqlens" \
    64:1024:1,64:4096:1,64:16384:1,128:1024:1,128:4096:1,128:16384:1,256:1024:1,256:4096:1,256:16384:1 \
    --columns pick,pick_pairs ;;
taillpt)
  # the backward launch order built 2026-12-01 evening (NOTES.md "Backward launch order")
  gated bwd_devrun "kw.get('tail_lpt')" tl \
    "bf16 h128 edv dqf tl causal gqa T<S;bf16 h128 tl deterministic causal gqa" \
    64:1024:1,64:4096:1,128:1024:1,128:4096:1,256:1024:1,256:4096:1 ;;
c2)
  # 64-row tiles at two CTAs per SM (cleared and picked at causal 1k 2026-12-01 late; NOTES.md
  # "Two CTAs per SM")
  gated devrun "kw.get('ctas_per_sm') == 2" c2 \
    "bf16 h128 m64c2 ps dense gqa odd;fp16 h128 m64c2 ps window seqlens" \
    64:1024:0,64:1024:1,64:4096:1,128:1024:0,128:1024:1,128:4096:0,128:4096:1 \
    --columns pick,m64c2_s1,m64c2_n64,m64c2_n64s3,m64c2_s1_pairs,m64c2_n64_pairs,m64c2_n64s3_pairs,m64c2_d64,m64c2_d64_pairs ;;
c2check)
  # the c2 check cases alone (their first run, in "c2" after "occ", found no GPU)
  check_cases devrun "kw.get('ctas_per_sm') == 2" c2 ;;
s3)
  # three K / V stages on the dense persistent picks (built 2026-12-01 late, not yet run): the
  # four check cases (two are the exact two-CTA picks), sanitizers on two, dense 1k / 4k bench
  gated devrun "kw.get('num_stages') == 3 and kw.get('persistent') or kw.get('tile_n') == 64 and kw.get('tile_order') == 'pairs'" s3 \
    "bf16 h128 ps s3 dense gqa odd;bf16 h64 m192 ps s3 dense odd" \
    64:1024:0,128:1024:0,64:4096:0,128:4096:0 --columns pick,p3,m192_ps_s3 ;;
msk)
  # mask_skip (built 2026-12-01 late, gated): its 6 check cases, sanitizers on two, the dense
  # picks with and without it
  gated devrun "kw.get('mask_skip')" msk "bf16 h128 msk dense gqa odd;fp16 h128 msk seqlens" \
    64:1024:0,128:1024:0,256:1024:0,64:4096:0,128:4096:0,128:16384:0 --columns pick,pick_msk ;;
msk2)
  # mask_skip at every dense point, the pick with and without it, reps interleaved (the
  # first msk bench timed the columns one after another): two benches
  for run in a b; do
    timeout 240 python3 -m devtools.devrun bench --columns pick,pick_msk --only \
      64:1024:0,128:1024:0,256:1024:0,64:4096:0,128:4096:0,256:4096:0,64:16384:0,128:16384:0,256:16384:0 \
      --out $OUT/cute-fwd-bench-msk2$run-$D.json 2>&1 | tail -10
  done ;;
sel)
  # mask_select (built 2026-12-02, gated): its 9 check cases, sanitizers on two, the causal
  # picks with and without it (reps interleaved)
  gated devrun "kw.get('mask_select')" sel \
    "bf16 h128 ps pairs sel causal T<S;fp16 h128 sel window seqlens" \
    64:1024:1,128:1024:1,128:4096:1,128:16384:1,256:1024:1,256:4096:1,256:16384:1 \
    --columns pick,pick_sel ;;
selcheck)
  # mask_select's check cases alone (hd 192's was added after the run that cleared it)
  check_cases devrun "kw.get('mask_select')" sel ;;
sel2)
  # mask_select's second bench
  timeout 240 python3 -m devtools.devrun bench --columns pick,pick_sel --only \
    64:1024:1,128:1024:1,128:4096:1,128:16384:1,256:1024:1,256:4096:1,256:16384:1 \
    --out $OUT/cute-fwd-bench-sel2-$D.json 2>&1 | tail -8 ;;
featsel)
  # masked calls off the grid (windows, key lengths): dispatch's variant beside the default
  # schedule and with mask_select flipped, reps interleaved, twice (`feat_bench.columns`)
  for run in a b; do
    timeout 200 python3 -m devtools.feat_bench --out $OUT/cute-fwd-featsel$run-$D.json \
      2>&1 | tail -6
  done ;;
featcheck)
  # the float64 cases of the plain schedules with windows / key lengths together (added
  # 2026-12-02 when dispatch gave those calls the plain schedule)
  timeout 150 python3 -m devtools.devrun check --cases "$(python3 -c "from devtools.fwd_cases import CHECKS; print(';'.join(n for n, kw, _ in CHECKS if kw.get('persistent') and (kw.get('has_window') or kw.get('has_kv_seqlen')) and (kw.get('mask_skip') or kw.get('mask_select') or kw.get('tile_m') == 192 and kw.get('is_causal'))))")" \
    --out $OUT/cute-fwd-check-featcheck-$D.json 2>&1 | grep -v -i warn | tail -14 ;;
qmc)
  # BwdConfig.q_multicast and do_first (gated, built 2026-12-02): their 19 float64 cases
  # first (a pair that deadlocks ends the stage there: rc 124), the D=256 points (columns
  # dqf_qmc, dqf_tl_qmc, dqf_dof, dqf_tl_dof, dqf_qmc_dof, dqf_tl_qmc_dof beside dqf /
  # dqf_tl, the picks), then memcheck and racecheck on the one-block case (phantom CTA) and
  # one do_first case
  C=$(python3 -c "from devtools.bwd_devrun import CHECKS; print(';'.join(n for n, kw, _ in CHECKS if kw.get('q_multicast') or kw.get('do_first')))")
  timeout 150 python3 -m devtools.bwd_devrun check --cases "$C" \
    --out $OUT/cute-bwd-check-qmc-$D.json > $OUT/cute-bwd-check-qmc-$D.log 2>&1
  rc=$?; grep -v -i warn $OUT/cute-bwd-check-qmc-$D.log | tail -14; echo "check rc=$rc"
  [ $rc = 124 ] && continue
  timeout 200 python3 -m devtools.bwd_devrun bench \
    --only 256:1024:0,256:1024:1,256:4096:0,256:4096:1,256:16384:0,256:16384:1 \
    --out $OUT/cute-bwd-bench-qmc-$D.json 2>&1 | tail -12
  for tool in memcheck racecheck; do
    timeout 60 compute-sanitizer --tool $tool --print-limit 20 python3 -m devtools.bwd_devrun \
      check --cases "bf16 h256 qmc tiny;bf16 h256 dof causal T>S softcap" --out $OUT/san-$tool.json > $OUT/cute-bwd-qmc-$tool-$D.log 2>&1
    echo "$tool rc=$?"; tail -1 $OUT/cute-bwd-qmc-$tool-$D.log
  done
  rm -f $OUT/san-*.json ;;
qmc128)
  # q_multicast at hd 128 (edv_dqf_qmc / edv_dqf_tl_qmc beside the picks edv_dqf / edv_dqf_tl)
  timeout 240 python3 -m devtools.bwd_devrun bench \
    --only 128:1024:0,128:1024:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1 \
    --out $OUT/cute-bwd-bench-qmc128-$D.json 2>&1 | tail -12 ;;
dqwg)
  # BwdConfig.dq_wg_flush (cleared 2026-12-02, not picked): 6 float64 cases, sanitizers on two, the
  # D=256 points (its columns dqf_wg / dqf_tl_wg were dropped from BENCH_VARIANTS after that run)
  gated bwd_devrun "kw.get('dq_wg_flush')" dqwg "bf16 h256 dqg causal T>S;fp16 h192 dqg window kvlen" \
    256:1024:0,256:1024:1,256:4096:0,256:4096:1,256:16384:0,256:16384:1 ;;
m256)
  # 256-row tiles, hd 64 (cleared and picked 2026-12-02): 7 float64 checks, sanitizers on two, the hd
  # 64 points against the picks (the target: 1k dense, 0.96x cuDNN in grids cc13 / cc14)
  gated devrun "kw.get('tile_m') == 256" m256 \
    "bf16 h64 m256 ps dense gqa odd;fp16 h64 m256 window seqlens" \
    64:1024:0,64:1024:1,64:4096:0,64:4096:1,64:16384:0 --columns pick,m256,m256_msk,m256_pairs ;;
occ)
  # launch stats and occupancy of our forward and cuDNN's at D=128 1k dense: CTAs per SM
  # ("Block Limit ...", achieved occupancy) decide the 1k design (NOTES.md "Two CTAs per SM")
  # (2026-12-01 late: unfiltered, ncu failed on XLA's input fusions and left the GPU unusable
  # for the next stage; only our forward and cuDNN's are profiled now, clocks unlocked as in
  # the profiles that worked; the second, filtered run was still at its first kernel at 200 s)
  timeout 150 ncu --clock-control none --section LaunchStats --section Occupancy \
    --kernel-name regex:"FlashFwdSm90|sdpa" --launch-count 2 python3 -m devtools.bwd_phases --only 128:1024:0 --ncu-loop 1 \
    --forward > $OUT/ncu-occupancy-fwd-h128-1k-$D.txt 2>&1
  grep -E "^  [a-zA-Z_].*\(|Block Limit|Registers Per Thread|Shared Memory Per Block|Block Size|Grid Size|Theoretical Occupancy|Achieved Occupancy|Duration" \
    $OUT/ncu-occupancy-fwd-h128-1k-$D.txt | cut -c1-110 | head -80 ;;
ncubwd)
  # Is the hd 256 backward bound by the L2 reduce-adds of dQ (64 KB per 64 x 64 step, twice
  # hd 128's per unit of work), shared memory, or latency? One launch of the main kernel each,
  # filtered by name (unfiltered ncu broke on XLA's fusions, see occ; not the zero fill)
  for pt in ${NCU_PTS:-256:4096:0 128:4096:0}; do
    timeout 200 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section WarpStateStats --section Occupancy \
      --metrics lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      --kernel-name regex:"cutlass_kernel_.*FlashBwd" --launch-count 1 python3 -m devtools.bwd_phases \
      --only $pt --ncu-loop 1 > $OUT/ncu-bwd-${pt//:/-}-$D.txt 2>&1
    echo "ncu $pt rc=$?"
    grep -E "^  [a-zA-Z_].*\(|Duration|Throughput|Pipe|Stall|lts__|sm__pipe|Bank|Warp Cycles|Issued|Eligible|Active Warps" \
      $OUT/ncu-bwd-${pt//:/-}-$D.txt | cut -c1-120 | head -70
  done ;;
gridcc)
  # the grid with ours and cuDNN only (~135 s on 2026-12-01): the issues' comparison, quickly
  timeout 300 python3 -m benchmarks.bench --out $OUT --name h200-$D-cc --impl cute,cudnn --budget-s 240 --stall-s 100 2>&1 | tail -40 ;;
grid)
  # alone in its call: 2026-12-01 with --budget-s 430 left three D=256 fwd+bwd points unmeasured
  timeout 585 python3 -m benchmarks.bench --out $OUT --name h200-$D --budget-s 530 --stall-s 120 2>&1 | tail -40 ;;
kbench)
  timeout 200 python3 -m devtools.devrun bench --out $OUT/cute-fwd-bench-$D.json 2>&1 | tail -25
  timeout 240 python3 -m devtools.bwd_devrun bench --out $OUT/cute-bwd-bench-$D.json 2>&1 | tail -25 ;;
sanitize)  # compute-sanitizer on small cases of the 2026-12-01 backward kernels
  SAN=${SAN_CASES:-"bf16 h256 tiny;bf16 h192 causal T>S;bf16 h64 alibi odd;bf16 h128 segments"}
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-280} compute-sanitizer --tool $tool --print-limit 20 python3 -m devtools.bwd_devrun \
      check --cases "$SAN" --out $OUT/san-$tool.json > $OUT/cute-bwd-$tool-$D.log 2>&1
    tail -3 $OUT/cute-bwd-$tool-$D.log
  done ;;
*) echo "unknown stage $stage" ;;
esac; done
