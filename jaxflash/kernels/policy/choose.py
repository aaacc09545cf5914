"""Which compiled variant serves a call: the one place that turns a `jaxflash._types.Problem`
into a forward `FwdConfig` and a backward `BwdConfig` (DSL-free).

Kept apart from `config.py` / `bwd_config.py` on purpose: those define what a binary *is* and
are hashed into every variant key (`jaxflash.ffi.variant.source_hash`); this module only picks
among binaries, from measurements, so changing a pick (after a benchmark) invalidates no
precompiled artifact. Nothing a kernel imports may import this module.
"""
from __future__ import annotations

from jaxflash.kernels.variants.bwd import TILE_M128_HEAD_DIMS, BwdConfig
from jaxflash.kernels.variants.bwd import can_implement as bwd_can_implement
from jaxflash.kernels.variants.fwd import FwdConfig
from jaxflash.kernels.variants.fwd import can_implement as fwd_can_implement

# `lazy_rescale` is picked above this key length (hd 64 dense, hd 256; not with softcap): the
# 16k grid points gained in two benches of 2026-12-01 (16:53 UTC), the 4k ones did not.
LAZY_MIN_KV_LEN = 8192
# head dims whose causal picks passed their `mask_select` float64 checks on the H200 (hd 192's
# case on 2026-12-02 03:40 UTC: checked, not benched; every other head dim gained 2-9%)
SELECT_HEAD_DIMS = (64, 96, 128, 192, 256)


def forward_config(problem) -> FwdConfig:
    """The forward variant serving a `jaxflash._types.Problem` (ValueError if none can)."""
    if min(problem.batch, problem.q_len, problem.num_heads) == 0:
        raise ValueError(f"empty problem (batch {problem.batch}, q_len {problem.q_len}, "
                         f"heads {problem.num_heads}): nothing to launch")
    ok, why = fwd_can_implement(dtype=problem.dtype, head_dim=problem.head_dim,
                                head_dim_v=problem.head_dim_v, features=problem.features())
    if not ok:
        raise ValueError(why)
    st = problem.statics
    features = dict(dtype=problem.dtype, head_dim=problem.head_dim,
                    head_dim_v=problem.head_dim_v, is_causal=st.is_causal,
                    has_window=st.window is not None, has_softcap=st.softcap is not None,
                    has_q_seqlen=problem.has_q_seqlen, has_kv_seqlen=problem.has_kv_seqlen,
                    has_alibi=problem.has_alibi, has_segments=problem.has_segments)
    # Windows and key lengths take the plain call's schedule too (`feat_bench`, two runs on
    # the H200, 2026-12-02 ~03:58 UTC, `h200-2026-12-02-cute-fwd-featsel{a,b}.json`: 1.03-1.26x
    # the default schedule on each of the six masked calls timed); ALiBi, segment ids and
    # query lengths were not timed with it and keep the default.
    tuned = not (problem.has_alibi or problem.has_segments or problem.has_q_seqlen)
    return FwdConfig(**features, **schedule_for(problem.head_dim, problem.kv_len, st.is_causal,
                                                plain=tuned, softcap=st.softcap is not None))


def schedule_for(head_dim: int, kv_len: int, causal: bool, plain: bool = True,
                 softcap: bool = False) -> dict:
    """Schedule fields that beat the default where measured (H200, same process as cuDNN;
    kernel benches `benchmarks/results/cute-fwd-bench-{m192ov,persist,m192ps,ps2}-h200-2026-12-01.json`,
    ratios to cuDNN, default -> picked):

    - hdim 64: 192 query rows (three consumer warpgroups) with intra-warpgroup overlap at every
      length; on the persistent loop where the key loop is short (S <= 1k, and causal S <= 4k),
      so a CTA's next tile's loads run under its current tile's epilogue. Two runs each
      (11:58 / 12:05 UTC), 192 rows non-persistent -> persistent: 1k dense 0.88 / 0.87 -> 0.99 /
      0.97, 1k causal 0.75 / 0.75 -> 0.87 / 0.88, 4k causal 1.02 / 1.01 -> 1.11 / 1.08; it lost
      at 4k dense (1.13 -> 1.08) and 16k causal (1.15 -> 0.92). (Before: 192 rows beat 128 rows
      at every length: 1k 0.77 -> 0.90 dense, 4k 0.93 -> 1.07, 16k 0.99 -> 1.16.)
    - hdim 128, S <= 1k: persistent with the tile pipe (the producer hands tile coordinates to
      the consumers): dense 0.91 -> 1.03 / 0.95, causal 0.84 -> 0.92 / 0.91 (11:58 / 12:05 UTC
      runs); plain persistent was 0.01-0.03 behind the tile pipe in all four comparisons of the
      day. At 16k persistent was +4% dense and -6% causal: not picked there.
    - hdim 256 dense, S <= 4k: persistent: 1k 1.01 -> 1.08 and 1.14 -> 1.16, 4k 1.12 -> 1.22 and
      1.14 -> 1.14 (two runs); 16k lost both times (1.21 -> 1.20, 1.15 -> 1.12), causal 1k
      too (1.06 -> 1.00, 1.11 -> 1.06).
    - hdim 64 causal, S <= 1k (no softcap): the same tile end-aligned (`m_align="end"`: the
      partial tile is the first, whose causal key range is the shortest; 28 key-block
      iterations instead of 32 at 1k): 0.88 -> 0.93 in the kernel bench of 12:33 UTC
      (`cute-fwd-bench-mend-h200-2026-12-01.json`); at 4k causal 1.08 -> 1.07 (not picked).
      10 float64 checks + bitwise repeats + memcheck passed (`cute-fwd-check-mend-*`).
      Superseded there (with `wg_epilogue` below) by two CTAs per SM, 2026-12-01 late.
    - S <= 1k at hdim 128, and hdim 64 causal S <= 1k: `wg_epilogue` on top (each consumer
      warpgroup stores its own rows and goes on to the next tile; under pingpong the second
      one otherwise holds the first at every tile's end). Two runs (15:25 UTC,
      `cute-fwd-bench-we{1,2}-h200-2026-12-01.json`), ratio to cuDNN without -> with: hd 128 1k
      dense 1.002 / 0.993 -> 1.014 / 1.010, causal 0.930 / 0.922 -> 0.950 / 0.924, hd 64 1k
      causal (end-aligned) 0.943 / 0.921 -> 0.959 / 0.951. Not picked where it did not help:
      hd 64 1k dense (0.950 / 0.949 -> 0.933 / 0.950), hd 64 4k causal (1.073 / 1.103 -> 1.060 /
      1.102), hd 128 4k dense (1.093 / 1.138 -> 1.076 / 1.064). 8 float64 checks with bitwise
      repeats, memcheck and racecheck clean (`cute-fwd-{check,we-*}-...`).
    - `lazy_rescale` (the O rescale skipped when no row of the warp raised its max; exact:
      bitwise the results without it) at kv_len > 8k for hd 64 dense and hd 256 (no softcap).
      Two benches of every grid point, the pick with and without it (16:53 UTC,
      `cute-fwd-bench-picklazy{1,2}-h200-2026-12-01.json`, ratio to cuDNN): hd 64 16k dense
      1.151 / 1.183 -> 1.184 / 1.243, hd 256 16k dense 1.090 / 1.096 -> 1.175 / 1.218, hd 256
      16k causal 1.271 / 1.299 -> 1.273 / 1.382; lost or mixed at 1k and 4k and at hd 128
      everywhere (16k dense 1.125 / 1.118 -> 1.068 / 1.054), hd 64 16k causal mixed (1.149 /
      1.225 -> 1.166 / 1.203). (With FA4's threshold 8 it had cost accuracy, and picked for
      every plain call, grid cc4 read 1.031x against cc3's 1.038x.)
    - causal hdim 128 (S <= 4k) and 256 (S <= 4k), no softcap: the persistent loop with the
      tile pipe taking a head's tiles two by two, m with nm - 1 - m (`tile_order="pairs"`:
      every pair holds the same causal work; LPT order left the busiest SM 1.19-1.21x the mean,
      `sched_model`). Two benches (21:40 / 21:50 UTC, `cute-fwd-bench-pairs{,2}-h200-
      2026-12-01.json`, ratio to cuDNN, pick -> pairs): hd 128 1k 0.946 / 0.958 -> 1.039 /
      0.946, 4k 1.068 / 1.065 -> 1.174 / 1.194; hd 256 1k 1.071 / 1.048 -> 1.146 / 1.119, 4k
      1.126 / 1.160 -> 1.223 / 1.227. Not at 16k (hd 128 1.108 / 1.213 -> 1.141 / 1.164, hd 256
      1.315 / 1.401 -> 1.293 / 1.231) nor hdim 64 (1k 0.958 / 0.918 -> 0.950 / 0.971, 4k
      1.123 -> 1.079).
    - causal hdim 64 / 128, S <= 1k, no softcap: 64-row tiles at two CTAs per SM
      (`ctas_per_sm=2`, one consumer warpgroup each; 64-key stages so two CTAs fit the SM's
      shared memory) on the persistent loop with paired tiles: one CTA's tile start and
      epilogue run under the other's key loop. Two benches (2026-12-01 23:25 / 23:35 UTC,
      `h200-2026-12-01-cute-fwd-bench-c2{,b}.json`, TFLOP/s pick -> this): hd 128 1k 386 / 385
      -> 410 / 417, hd 64 1k 290 / 290 -> 299 / 299. Not at 4k causal (hd 128 557 -> 500, hd 64
      440 -> 381) nor dense 1k (hd 128 521 -> 517, hd 64 384 / 389 -> 384 / 384).
    - dense hdim 128 (every length) and hdim 64 at 1k < S <= 8k, no softcap: `mask_skip` (a key
      block wholly inside the key length skips its per-score compares; at S a multiple of the
      tile that is every block). Two benches with the columns' reps interleaved (2026-12-02
      01:30 UTC, `h200-2026-12-02-cute-fwd-bench-msk2{a,b}.json`, TFLOP/s pick -> with it):
      hd 128 1k 490 / 485 -> 568 / 566, 4k 601 / 604 -> 630 / 634, 16k 640 / 639 -> 642 /
      650; hd 64 4k 469 / 474 -> 475 / 481. Not at hd 64 1k (384 / 380 -> 382 / 386) or 16k
      (543 / 548 -> 533 / 532, with lazy_rescale), nor hd 256 (1k 559 / 561 -> 569 / 558, 4k
      686 / 680 -> 678 / 668, 16k equal). Causal blocks all carry the diagonal bound: nothing
      to skip there.
    - causal, every length (softcap too), head dims 64 / 96 / 128 / 256, except the 192-row
      tiles that always have it: `mask_select` (a masked block's scores set by one select
      each instead of the conditional stores' cascade of ~14 selects per score; every causal
      tile's diagonal block is masked). Two benches, reps interleaved (2026-12-02 01:55 UTC,
      `h200-2026-12-02-cute-fwd-bench-sel{,2}.json`, TFLOP/s pick -> with it): hd 64 1k
      296 / 296 -> 321 / 324, hd 128 1k 389 / 403 -> 420 / 427, 4k 536 / 533 -> 582 / 572,
      16k 592 / 596 -> 608 / 611, hd 256 1k 413 / 416 -> 439 / 439, 4k 593 / 590 -> 603 /
      595, 16k 710 / 709 -> 710 / 711.
    - dense hdim 64, S <= 2k, no softcap: 256-row tiles (four 64-row consumer warpgroups at 112
      registers, 64-key stages, persistent with the tile pipe) with `mask_skip`: 1k and 2k
      have no partial tile then (192 rows leave one tile of six a third full at 1k). Three
      benches at 1k (2026-12-02 05:30-05:37 UTC, `h200-2026-12-02-cute-fwd-bench-m256{,b,c}.
      json`, ratio to cuDNN, pick -> 256 rows / with mask_skip): 0.971 / 0.962 / 0.973 ->
      1.088 / 1.075 / 1.088 and 1.122 / 1.116 / 1.126; two at 2k (05:43 / 05:48 UTC,
      `...-m256-2k{,b}.json`; the pick there: 192 rows with mask_skip): 1.067 / 1.059 ->
      1.087 / 1.073 and 1.106 / 1.087. Not at 4k dense (1.101 / 1.085 / 1.087 -> 1.080 /
      1.063 / 1.068, with mask_skip 1.079 / 1.069 / 1.075), 16k dense (1.192 -> 1.048), nor
      causal with paired tiles (1k 1.105 / 1.122 / 1.082 -> 1.043 / 1.051 / 1.020, 4k 1.096
      -> 1.062). 7 float64 checks (error 0.98-1.00x cuDNN's), memcheck clean, racecheck's one
      report inside cuDNN's kernel.
    Dropped: three K/V stages at hdim 128, S = 16k (picked until 2026-12-01) lost in both runs
    of that day (1.11 -> 1.07 dense, 1.21 -> 1.14 causal).

    Measured on causal / dense (and softcap) calls, and (`feat_bench`, 2026-12-02) on
    windows and key lengths, which get the same schedule; calls with ALiBi, segment ids or
    query lengths keep the default (``plain=False``). Crossing a threshold picks another
    variant (one more compile), nothing else does.
    """
    if not plain:
        return {}
    sched = _schedule(head_dim, kv_len, causal, softcap)
    # one select per score on the causal diagonal blocks (192-row tiles have it built in)
    select = ({"mask_select": True} if causal and sched.get("tile_m") != 192
              and head_dim in SELECT_HEAD_DIMS else {})
    return {**sched, **_mask_skip(head_dim, kv_len, causal, softcap), **select}


def _mask_skip(head_dim: int, kv_len: int, causal: bool, softcap: bool) -> dict:
    """`mask_skip` where it was measured to pay (`schedule_for`'s list)."""
    if causal or softcap:
        return {}
    if head_dim == 128 or (head_dim == 64 and 1024 < kv_len <= LAZY_MIN_KV_LEN):
        return {"mask_skip": True}
    return {}


def _schedule(head_dim: int, kv_len: int, causal: bool, softcap: bool) -> dict:
    """The tile / loop fields of `schedule_for` (plain calls)."""
    # FA4's conditional O rescale (exact here: threshold 0) pays only on long key loops at
    # hd 64 dense and hd 256; measured at 16k, lost or mixed at 4k: the cut is half-way (log).
    lazy = {"lazy_rescale": True} if kv_len > LAZY_MIN_KV_LEN and not softcap else {}
    if causal and kv_len <= 1024 and not softcap and head_dim in (64, 128):
        # two CTAs per SM: 64-row tiles, two 64-key stages, persistent, paired causal tiles
        return {"tile_m": 64, "ctas_per_sm": 2, "tile_n": 64, "persistent": True,
                "tile_pipe": True, "tile_order": "pairs"}
    if head_dim == 64 and not causal and kv_len <= 2048 and not softcap:
        # four 64-row consumer warpgroups: no partial tile at 1k / 2k (`schedule_for`'s list)
        return {"tile_m": 256, "tile_n": 64, "persistent": True, "tile_pipe": True,
                "mask_skip": True}
    if head_dim == 64:
        short = kv_len <= 1024 or (causal and kv_len <= 4096)
        if short:
            return {"tile_m": 192, "persistent": True}
        return {"tile_m": 192, **({} if causal else lazy)}
    # causal hd 128 / 256 up to 4k: the persistent loop with paired tiles (m, nm - 1 - m)
    pairs = {"tile_order": "pairs"} if causal and not softcap else {}
    if head_dim == 128 and kv_len <= 1024:  # (causal without softcap took two CTAs above)
        return {"persistent": True, "tile_pipe": True, "wg_epilogue": True}
    if head_dim in (128, 256) and kv_len <= 4096 and (pairs or not causal):
        return {"persistent": True, "tile_pipe": True, **pairs}
    if head_dim == 256:
        return lazy
    return {}


def backward_config(problem) -> BwdConfig:
    """The backward variant serving a `jaxflash._types.Problem` (ValueError if none can)."""
    if min(problem.batch, problem.q_len, problem.kv_len, problem.num_heads) == 0:
        raise ValueError(f"empty problem (batch {problem.batch}, q_len {problem.q_len}, "
                         f"kv_len {problem.kv_len}, heads {problem.num_heads})")
    st = problem.statics
    tail = use_tail_lpt(problem)
    ok, why = bwd_can_implement(dtype=problem.dtype, head_dim=problem.head_dim,
                                head_dim_v=problem.head_dim_v, features=problem.features())
    if not ok:
        raise ValueError(why)
    return BwdConfig(dtype=problem.dtype, head_dim=problem.head_dim,
                     head_dim_v=problem.head_dim_v, is_causal=st.is_causal,
                     has_window=st.window is not None, has_softcap=st.softcap is not None,
                     has_q_seqlen=problem.has_q_seqlen, has_kv_seqlen=problem.has_kv_seqlen,
                     has_alibi=problem.has_alibi, has_segments=problem.has_segments,
                     deterministic=st.deterministic,
                     tile_m=tile_m_for(problem.head_dim, st.softcap is not None,
                                       problem.has_alibi),
                     early_dv=use_early_dv(problem.head_dim, st.softcap is not None,
                                           st.deterministic),
                     dq_flat=use_dq_flat(problem.head_dim, st.softcap is not None,
                                         problem.has_alibi, problem.has_segments,
                                         (st.is_causal and not tail) or st.window is not None),
                     tail_lpt=tail, q_multicast=use_q_multicast(problem))


def use_q_multicast(problem) -> bool:
    """q_multicast (key blocks 2j / 2j + 1 as a cluster, Q / dO halves multicast to both) on
    plain dense hd 256 calls with at least 4k keys. H200, 2026-12-02 12:33 / 12:49 UTC
    (`benchmarks/results/h200-2026-12-02-cute-bwd-bench-{qmc,dqs}.json`), fwd+bwd ms, dq_flat
    alone -> with q_multicast: 4k dense 4.150 -> 3.927 / 4.109 -> 4.051 (the clear gain: the
    step there is L2-bound, 83% of peak in ncu), 16k dense 16.08 -> 15.98 / 15.93 -> 15.77,
    1k dense 1.190 -> 1.206 (slower: not picked), causal 1k / 4k / 16k 1-6% slower than the
    tail_lpt pick (the coupled pair waits on its slower CTA). 19 float64 checks (hd 128 / 192 / 256, odd block counts with a phantom
    CTA, causal, T < S / T > S, lengths with empty rows, softcap, tail_lpt; error 1.00x
    cuDNN's on the 2k cases), memcheck and racecheck clean."""
    st = problem.statics
    return (problem.head_dim == 256 and not st.is_causal and st.window is None
            and st.softcap is None and not st.deterministic and not problem.has_segments
            and problem.kv_len >= 4096)


def use_tail_lpt(problem) -> bool:
    """tail_lpt (the last heads' CTAs launched key-block-major, so the causal grid does not end
    on long CTAs; `bwd_order`) on plain causal calls (lengths allowed), not deterministic.
    H200, 2026-12-01, backward alone, two benches each (`cute-bwd-bench-tl{,2}-h200-
    2026-12-01.json`, ms without -> with): hd 128 (early_dv + dq_flat) 1k 0.754 / 0.772 ->
    0.743 / 0.734, 4k 1.980 / 1.929 -> 1.938 / 1.919; hd 256 (dq_flat) 1k 0.779 / 0.776 ->
    0.765 / 0.768, 4k 2.247 / 2.256 -> 2.217 / 2.222; hd 64 (128-query step) 1k 0.956 /
    0.965 -> 0.949 / 0.948, 4k 2.398 -> 2.377 with dq_flat, which pays there only with
    tail_lpt (0.952 / 0.969 without). 8 float64 checks, memcheck and racecheck clean. Not with
    windows, softcap, ALiBi or segment ids (not checked with them)."""
    st = problem.statics
    return (st.is_causal and st.window is None and st.softcap is None and not st.deterministic
            and not problem.has_alibi and not problem.has_segments)


def use_dq_flat(head_dim: int, softcap: bool, alibi: bool, segments: bool,
                masked: bool) -> bool:
    """dq_flat (the dQ tile in fragment order, one bulk reduce per step; FA4's dQ path)
    wherever the step is 64 queries, and on hd 64's 128-query step without a causal / window
    mask. H200, 2026-12-01, backward alone vs the plain 64-query step
    (`benchmarks/results/cute-bwd-bench-dqf{1,64}-h200-2026-12-01.json`; 1k, 4k dense, 4k
    causal, 16k dense, 16k causal): hd 256 1.061 / 1.084 / 1.095 / 1.072 / 1.080 (the default
    is the plain step there); hd 128 with early_dv 1.054 / 0.990 / 1.005 / 1.060 / 1.030
    against early_dv's 1.000 / 0.956 / 0.989 / 0.996 / 1.031; hd 64 at 128 queries 1.206 /
    1.205 / 1.192 / 1.222 / 1.209 against 1.133 / 1.156 / 1.201 / 1.149 / 1.238 (the causal
    points a little slower: not picked there). 23 float64 checks (hd 64 / 96 / 128 / 192 /
    256, fp16, windows, lengths with empty rows, deterministic; error 1.00x cuDNN's on the 2k
    cases), bitwise determinism, memcheck and racecheck clean. Not with ALiBi or segment ids
    (not checked with them), nor softcap at hd 128 (ptxas spills 24 B)."""
    if alibi or segments or (softcap and head_dim == 128):
        return False
    return tile_m_for(head_dim, softcap, alibi) == 64 or not masked


def use_early_dv(head_dim: int, softcap: bool, deterministic: bool) -> bool:
    """early_dv where it was measured correct and faster (H200, 2026-11-30,
    `benchmarks/results/cute-bwd-variants-h200-2026-11-30.json`): hdim 128 forward+backward
    1.00-1.04x the default (dense 4k 1.04, causal 16k 1.03), checked against float64 on causal
    GQA T<S, dense 2k, lengths with empty rows and window T>S. At hdim 64 it was slower
    (0.95-0.96x); with softcap at hdim 128 it spills (refused); with deterministic it was not
    run on the GPU, so it stays off there."""
    return head_dim == 128 and not softcap and not deterministic


def tile_m_for(head_dim: int, softcap: bool, alibi: bool) -> int:
    """128 queries per step where it is allowed (hd 64 without softcap / ALiBi: those spill)
    and measured: H200, 2026-12-01, same process as cuDNN
    (`benchmarks/results/cute-bwd-bench-m128-h200-2026-12-01.json`): forward+backward
    1.09-1.15x the 64-query step (backward alone 1.13-1.21x) at S 1k / 4k / 16k dense and
    4k / 16k causal; checked against float64 on 16 cases (causal, window, lengths with empty
    rows, GQA / MQA, odd lengths, segment ids, fp16, both dQ modes, deterministic)."""
    if head_dim in TILE_M128_HEAD_DIMS and not softcap and not alibi:
        return 128
    return 64
