"""Which kernel variants have been checked on a GPU, and the switch that admits the others.

CI compiles every variant for sm_90a without a GPU, but compiling proves nothing about the
numbers. A variant whose features were written and compiled here but have not yet been compared
with the float64 reference on a real GPU is *unverified*: dispatch does not choose it (the call
runs on the Pallas path, and ``explain`` says why), unless the user opts in with
``JAXFLASH_CUTE_UNVERIFIED=1`` (for whoever runs the GPU checks, or wants to try them).

What is pending lives here, in `RULES`, and not in the config classes: `config.py` and
`bwd_config.py` are hashed into every compiled artifact's key (`jaxflash.ffi.variant`), so clearing
a feature after its GPU run would otherwise invalidate every precompiled binary (the same reason
`choose.py` is apart). This module only names features; nothing a kernel imports imports it. The
run-by-run history (which check cases, which result files) is in `jaxflash/kernels/NOTES.md`.
"""
from __future__ import annotations

import os

ENV = "JAXFLASH_CUTE_UNVERIFIED"


def allowed() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


# Per config class: (feature name, predicate) pairs; a config using a named feature is pending.
# Forward: nothing. wg_epilogue passed 8 float64 checks (bitwise repeats, 192-row end-aligned
# tiles, lengths), memcheck and racecheck on the H200 (2026-12-01 15:25 UTC). End-aligned query tiles v2 (m_align="end", clamped first tile) passed 10
# float64 checks, bitwise-identical repeats and memcheck on the H200 (2026-12-01 12:33 UTC;
# the first, unclamped attempt had crashed there); the 192-row persistent tile passed 6 checks
# and the sanitizer the same day.
# Backward: overlap_dq at tile_m 128 and dq_arrive passed their float64 checks on 2026-12-01,
# but dq_arrive's memcheck crashed inside compute-sanitizer and neither beat the default beyond
# noise, so they stay out of dispatch until a clean memcheck. tile_m 80 (hd 128 dense,
# `hopper_bwd_m80`) is cleared: its 6 float64 check cases passed on the H200 (2026-12-01 13:45
# UTC, after the LSE / delta stage alignment fix), memcheck and racecheck clean; `choose` does
# not pick it (0.87x early_dv's speed there). overlap_dq at hd 128 (with early_dv) and
# dq_writer are cleared (2026-12-01, 15:00-15:12 UTC): 6 and 7 float64 cases passed (dK / dV / dQ
# error 1.00x cuDNN's on the 2k cases), memcheck and racecheck clean on two cases each
# (`cute-bwd-*-ovl128-*`, `cute-bwd-*-dqw*`); `choose` picks neither (within noise of
# early_dv in three benches).
RULES = {
    # lazy_rescale passed its 7 float64 checks and memcheck with FA4's threshold 8 (2026-12-01
    # 15:55 UTC); that threshold cost accuracy (error 1.04-1.16x cuDNN's), so it is 0 now: the
    # same code path, results bitwise those without it (6 configs on the H200, 16:03 UTC,
    # `cute-fwd-lazy0-exact-*`). Cleared; `choose` does not pick it (grid cc4).
    # tile_order "pairs" (tile m and tile nm - 1 - m of a head on one persistent CTA) passed
    # 10 float64 checks (hd 64 / 96 / 128 / 256, end-aligned, window with lengths, fp16, T < S
    # and T > S), memcheck clean; racecheck's two reports are inside cuDNN's fp16 kernel (the
    # comparison run), none in ours (H200, 2026-12-01 21:40 UTC, `cute-fwd-*-pairs-*`): cleared.
    # 64-row tiles at two CTAs per SM passed 9 float64 checks (hd 64 / 96 / 128, persistent or
    # not, pairs, T < S, window with lengths and empty rows, softcap, fp16, GQA with odd
    # lengths; error 1.00x cuDNN's), memcheck clean; racecheck's one report is inside cuDNN's
    # fp16 kernel (H200, 2026-12-01 23:25-23:35 UTC, `h200-2026-12-01-cute-fwd-*c2*`): cleared,
    # and picked at causal S <= 1k (`choose.schedule_for`).
    # mask_skip (a warp-uniform test instead of per-score compares on blocks only the key
    # length could cut) passed 6 float64 checks (hd 64 / 128 / 256, key lengths on and off the
    # tile, per-batch lengths with empty rows, T > S, fp16, the two-CTA tile; error 1.00x
    # cuDNN's; one bitwise repeat), memcheck clean; racecheck's one report is inside cuDNN's
    # fp16 kernel (H200, 2026-12-02 01:25 UTC, `h200-2026-12-02-cute-fwd-*msk*`): cleared, and
    # picked at dense hd 128 and hd 64 4k (`choose.schedule_for`).
    # mask_select (one select per score on masked blocks at the tiles other than 192 rows)
    # passed 9 float64 checks (the causal picks of hd 64 / 128 / 256 with two CTAs, pairs and
    # the default; T < S, softcap, fp16 window with lengths and empty rows, a dense key tail,
    # hd 96; error 0.994-0.999x cuDNN's; a bitwise repeat), memcheck clean; racecheck's one
    # report is inside cuDNN's fp16 kernel (H200, 2026-12-02 01:55 UTC,
    # `h200-2026-12-02-cute-fwd-*sel*`): cleared, and picked at causal (`choose.schedule_for`).
    # 128-row tiles at two CTAs per SM (hd 64, 64-key stages): HANG on the H200 (2026-12-02
    # 03:35 UTC, `cute-fwd-m128c2-*-h200-2026-12-02.log`): the consumers' setmaxnreg.inc to
    # 112 needs 256 x 32 registers, the producer's decrease from 80 to 24 frees 128 x 56, and an
    # increase only takes what its CTA freed (at 104 ptxas spills 48 B and serializes the
    # wgmma). Never to be cleared as built (a one-warp producer compiled to 96 registers with
    # spills: NOTES.md).
    # 256-row tiles, four consumer warpgroups (hd 64, 0 spills at 112) passed 7 float64 checks
    # (dense odd lengths with GQA, 1k against cuDNN with a bitwise repeat, mask_skip with T > S,
    # shorter than a tile, causal pairs and T < S, fp16 window with lengths and empty rows;
    # error 0.98-1.00x cuDNN's), memcheck clean, racecheck's one report inside cuDNN's kernel
    # (H200, 2026-12-02 05:30 UTC, `h200-2026-12-02-cute-fwd-*m256*`): cleared, and picked at
    # dense hd 64 S <= 2k (`choose.schedule_for`).
    "FwdConfig": (("two CTAs per SM at tile_m 128",
                   lambda c: c.ctas_per_sm == 2 and c.tile_m == 128),),
    # dq_flat passed 17 float64 checks, determinism and the sanitizers on the H200 (2026-12-01
    # 17:05 UTC, `cute-bwd-{check,determinism}-dqf-*`): cleared, and picked (`choose`).
    # dq_flat with dq_writer passed 6 float64 checks (hd 96 / 128, fp16, windows, lengths with
    # empty rows, GQA / MQA; error 1.00x cuDNN's on the 2k case), memcheck and racecheck on the
    # H200 (2026-12-01 18:50 UTC, `cute-bwd-check-dqwf-*`): cleared; not picked (two benches:
    # within noise of dq_flat alone but at dense 4k, 5% slower at dense 16k).
    # dq_wg_flush (the wide kernel's warpgroups each reduce-add their own dQ half) passed 6
    # float64 checks (hd 192 / 256, odd lengths, GQA with T < S, T > S, softcap, fp16 window
    # with key lengths; error 1.00x cuDNN's on the 2k case), memcheck and racecheck clean
    # (H200, 2026-12-02 05:33 UTC, `h200-2026-12-02-cute-bwd-*dqwg*`): cleared; not picked
    # (fwd+bwd against dq_flat alone at D=256: 1-6% slower dense, within 1.3% causal).
    "BwdConfig": (("overlap_dq with tile_m 128", lambda c: c.overlap_dq and c.tile_m == 128),
                  ("dq_arrive", lambda c: c.dq_arrive)),
    # q_multicast (key-block pairs sharing Q / dO by TMA multicast) and do_first (the wide
    # kernel's dO-first step) passed 19 float64 checks between them (hd 128 / 192 / 256, odd
    # block counts with the phantom CTA, causal, T < S and T > S, lengths with empty rows,
    # softcap, windows (do_first), tail_lpt; error 1.00x cuDNN's on the 2k cases), memcheck and
    # racecheck clean (H200, 2026-12-02 12:33 UTC, `h200-2026-12-02-cute-bwd-*qmc*`): cleared;
    # q_multicast picked at dense hd 256 from 4k keys (`choose.use_q_multicast`), do_first
    # nowhere (within 1% of the picks, mostly behind).
    # tail_lpt (the last heads launched key-block-major) passed 8 float64 checks (hd 64 / 128 /
    # 256, GQA, many heads, T < S and T > S, lengths with empty rows, fp16, deterministic; 2k
    # vs cuDNN), memcheck and racecheck clean (H200, 2026-12-01 21:35-21:50 UTC,
    # `cute-bwd-check-tl*`): cleared, and picked at causal (`choose.use_tail_lpt`).
}


def pending(config) -> tuple[str, ...]:
    """The features of `config` not yet cleared for dispatch (empty when all were checked;
    a config class without rules has none pending)."""
    return tuple(name for name, uses in RULES.get(type(config).__name__, ()) if uses(config))


def require_verified(config, what: str) -> None:
    """NotImplementedError naming the unverified features of `config` unless the switch is on."""
    pending_ = pending(config)
    if pending_ and not allowed():
        raise NotImplementedError(
            f"the CuTe {what} variant {config.key} uses {', '.join(pending_)}, compiled but not yet "
            f"checked on a GPU; set {ENV}=1 to run it anyway")
