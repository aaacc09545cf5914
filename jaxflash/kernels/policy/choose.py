"""Which compiled variant serves a call: the one place that turns a `jaxflash._types.Problem`
into a forward `FwdConfig` and a backward `BwdConfig` (DSL-free).

Kept apart from `variants/fwd.py` / `variants/bwd.py` on purpose: those define what a binary
*is* and are hashed into every variant key (`jaxflash.ffi.variant.source_hash`); this module only
picks among binaries, from measurements (H200, same process as cuDNN; the benches and their
numbers are in docs/design.md), so changing a pick invalidates no precompiled artifact. Nothing
a kernel imports may import this module.
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.policy import verified
from jaxflash.kernels.variants.bwd import TILE_M128_HEAD_DIMS, BwdConfig
from jaxflash.kernels.variants.bwd import can_implement as bwd_can_implement
from jaxflash.kernels.variants.bwd_fp8 import Fp8BwdConfig
from jaxflash.kernels.variants.bwd_fp8 import can_implement as fp8_bwd_can_implement
from jaxflash.kernels.variants.fwd import FwdConfig
from jaxflash.kernels.variants.fwd import can_implement as fwd_can_implement
from jaxflash.kernels.variants.fwd_fp8 import Fp8FwdConfig
from jaxflash.kernels.variants.fwd_fp8 import can_implement as fp8_can_implement
from jaxflash.kernels.variants.mod_program import spec_texts
from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig
from jaxflash.kernels.variants.sm100_fwd import can_implement as sm100_can_implement
from jaxflash.kernels.variants.sm100_bwd import Sm100BwdConfig
from jaxflash.kernels.variants.sm100_bwd import can_implement as sm100_bwd_can_implement
from jaxflash.kernels.variants.sm100_fwd_fp8 import Sm100Fp8FwdConfig

# `lazy_rescale` is picked above this key length (hd 64 dense, hd 256; not with softcap): the
# 16k grid points gained in two benches, the 4k ones did not.
LAZY_MIN_KV_LEN = 8192
# FP8 forward: causal calls with at most this many keys take the persistent tile loop
FP8_PERSISTENT_MAX_KV = 1024
# head dims whose causal picks passed their `mask_select` float64 checks on the H200 (hd 192:
# checked, not benched; every other head dim gained 2-9%)
SELECT_HEAD_DIMS = (64, 96, 128, 192, 256)


def _nonempty(problem, keys: bool = False) -> None:
    """ValueError for a problem with nothing to launch (`keys`: an empty key sequence too, as
    for the backward, whose grid runs over key blocks)."""
    dims = [problem.batch, problem.q_len, problem.num_heads] + ([problem.kv_len] if keys else [])
    if min(dims) == 0:
        raise ValueError(f"empty problem (batch {problem.batch}, q_len {problem.q_len}, "
                         f"kv_len {problem.kv_len}, heads {problem.num_heads}): nothing to "
                         "launch")


def _implementable(problem, can_implement, features=None) -> None:
    """ValueError with the variant's own reason unless `can_implement` accepts the problem's
    dtype, head dims and `features` (the problem's by default)."""
    ok, why = can_implement(dtype=problem.dtype, head_dim=problem.head_dim,
                            head_dim_v=problem.head_dim_v,
                            features=problem.features() if features is None else features)
    if not ok:
        raise ValueError(why)


def _common_fields(problem, alibi: bool = True) -> dict:
    """The config fields every variant takes from the problem: dtype, head dims, the masks."""
    st = problem.statics
    f = dict(dtype=problem.dtype, head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
             is_causal=st.is_causal, has_window=st.window is not None,
             has_softcap=st.softcap is not None, has_q_seqlen=problem.has_q_seqlen,
             has_kv_seqlen=problem.has_kv_seqlen, has_segments=problem.has_segments)
    if alibi:  # (the FP8 forward has no ALiBi field)
        f["has_alibi"] = problem.has_alibi
    return f


def forward_config(problem) -> FwdConfig:
    """The forward variant serving a `jaxflash._types.Problem` (ValueError if none can)."""
    _nonempty(problem)
    _implementable(problem, fwd_can_implement)
    st = problem.statics
    features = _common_fields(problem)
    # Windows and key lengths take the plain call's schedule too (`devtools.feat_bench`, two
    # runs: 1.03-1.26x the default schedule on each of the six masked calls timed); ALiBi,
    # segment ids and query lengths were not timed with it and keep the default.
    tuned = not (problem.has_alibi or problem.has_segments or problem.has_q_seqlen)
    mods = spec_texts(problem.mods)
    if mods:
        return FwdConfig(**features, score_mod=mods["score"], mask_mod=mods["mask"],
                         **mod_schedule(problem.head_dim, problem.kv_len, st.is_causal,
                                        bool(mods["score"])))
    sched = schedule_for(problem.head_dim, problem.kv_len, st.is_causal, plain=tuned,
                         softcap=st.softcap is not None)
    if tuned and short_window(problem.head_dim, problem.kv_len, st.window,
                              st.softcap is not None):
        sched = {**sched, **SHORT_WINDOW_SCHEDULE}
    return FwdConfig(**features, **sched)


# A sliding window visits as few key blocks per tile as a short sequence does, however long
# the keys: at hd 128 the short-sequence loop (persistent, the producer decoding tiles, each
# warpgroup storing its own rows) won there too. Measured (mods_kernel_bench --schedules, H200,
# causal window (1024, 0) at 16k, TFLOP/s over the visited tiles / the dense kernel's):
# default 0.72, persistent + tile pipe 0.78, with paired tiles 0.79, + per-warpgroup epilogue
# 0.81. Other head dims, spans and key lengths of 4k or less (where the plain pick is already
# a persistent one) were not timed and keep the plain pick.
SHORT_WINDOW_SCHEDULE = {"persistent": True, "tile_pipe": True, "wg_epilogue": True,
                         "tile_order": "auto", "lazy_rescale": False, "mask_skip": False}
SHORT_WINDOW_SPAN = 2048


def short_window(head_dim: int, kv_len: int, window, softcap: bool) -> bool:
    """Whether a windowed call takes `SHORT_WINDOW_SCHEDULE`: hd 128, no softcap, more than 4k
    keys, a window (left + right + 1) of at most `SHORT_WINDOW_SPAN` keys."""
    if window is None or head_dim != 128 or softcap or kv_len <= 4096:
        return False
    left, right = window
    if min(left, right) < 0:
        return False
    span = left + right + 1
    return span <= SHORT_WINDOW_SPAN


def window_only(statics, head_dim: int, kv_len: int):
    """`statics` with ``is_causal`` and a window (left, right >= 0) given as the window
    (left, 0) alone, where that is the short-window regime (`short_window`), else `statics`.

    The two masks are one (both keep left >= q - k >= 0, `jaxflash.masking.keep`), but the
    causal flag makes another variant: at hd 128, 16k keys, window (1024, 0), its forward took
    1.06x, 1.06x and 1.15x the window alone's in three runs of `benchmarks.mods_bench` (H200,
    H200, H100; forward + backward 1.00x and 1.08x in two). The window mask_mod runs as this
    built-in too (`mod_builtin`), hence as fast as the fastest built-in form. Plain calls only
    (no score_mod, no FP8)."""
    w = statics.window
    if (not statics.is_causal or w is None or w[1] < 0 or statics.mods is not None
            or getattr(statics, "fp8", None) is not None
            or not short_window(head_dim, kv_len, (w[0], 0), statics.softcap is not None)):
        return statics
    return dataclasses.replace(statics, is_causal=False, window=(w[0], 0))


def fp8_forward_config(problem) -> Fp8FwdConfig:
    """The FP8 forward variant serving an FP8 `Problem` (``statics.fp8`` set; ValueError if
    none can). One tile per CTA, 128 x 128 tiles (the contract's 128-key softmax tiles), causal
    diagonal blocks masked by select as in the bf16 picks."""
    _nonempty(problem)
    spec = problem.statics.fp8
    if spec is None:
        raise ValueError("not an FP8 call")
    dtypes = {spec.q_dtype, spec.k_dtype, spec.v_dtype}
    if dtypes != {"float8_e4m3fn"}:
        raise ValueError(f"FP8 kernel operands are e4m3 only (got q/k/v {spec.q_dtype}, "
                         f"{spec.k_dtype}, {spec.v_dtype})")
    if spec.out_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"the FP8 kernel writes bfloat16 / float16 output (out_dtype "
                         f"{spec.out_dtype} asked)")
    # Scales: one per (batch, head) (the block covers the sequence), or one per tile of rows
    # (the contract's 128-row blocks: the kernel's 128 x 128 tiles).
    tile = 128
    blocks = {}
    for name, block, length in (("q", spec.q_block, problem.q_len),
                                ("k", spec.k_block, problem.kv_len),
                                ("v", spec.v_block, problem.kv_len)):
        blocks[f"{name}_blocks"] = block < length
        if block < length and block != tile:
            raise ValueError(f"{name} scales per {block}-row block: the FP8 kernel takes one "
                             f"scale per {tile} rows or per (batch, head) only")
    _implementable(problem, fp8_can_implement,
                   tuple(f for f in problem.features() if f != "fp8"))
    # V^T from the XLA side: the in-kernel transpose cost 40-60% of the forward's time
    # (`fp8-fwd-diag-h200-*.json`); with V^T given, hd 128 / 256 ran 1.5-2.2x faster.
    cfg = Fp8FwdConfig(out_dtype=spec.out_dtype, mask_select=problem.statics.is_causal,
                       v_transposed=True, **_common_fields(problem, alibi=False), **blocks)
    if problem.head_dim == 64 and not blocks["q_blocks"]:
        # 192-row tiles at hd 64 (the bf16 pick): +25-31% with the in-kernel transpose
        # (`fp8-fwd-diag-h200-*.json`, "m192"); q scales in 128-row blocks do not
        # tile them. Taken once their GPU check clears them (`verified.RULES`).
        wide = dataclasses.replace(cfg, tile_m=192, mask_select=False)
        if not verified.pending(wide) or verified.allowed():
            cfg = wide
    # Measured beside the plain pick (`fp8_bench run --tiles`, H200, per-tensor scales): the
    # persistent tile loop gained 12% on causal 1k at hd 64 and 128 (a causal tile visits
    # few key blocks there), lost 8% at hd 128 causal 4k and was even on dense 1k; the
    # conditional O rescale gained 1-5% at hd 64 from 4k keys (not with v blocks: each block
    # rescales O by the ratio of consecutive v scales) and was within 2% either way at hd 256.
    change = {}
    if problem.statics.is_causal and problem.kv_len <= FP8_PERSISTENT_MAX_KV and \
            problem.head_dim in (64, 128):
        change["persistent"] = True
    if problem.head_dim == 64 and problem.kv_len >= 4096 and not blocks["v_blocks"]:
        change["lazy_rescale"] = True
    if change:
        tuned = dataclasses.replace(cfg, **change)
        if tuned.check()[0] and (not verified.pending(tuned) or verified.allowed()):
            cfg = tuned
    return cfg


def fp8_backward_config(problem) -> Fp8BwdConfig:
    """The FP8 backward variant serving an FP8 `Problem` (ValueError if none can): e4m3 q, k,
    v, dO in the spec's format, 64-query steps over 128-key blocks (64-key blocks at hd 256).
    Every scale block must lie within one kernel tile's rows (q: 64 queries, k / v: the key
    tile) or cover the sequence."""
    _nonempty(problem, keys=True)
    spec = problem.statics.fp8
    if spec is None:
        raise ValueError("not an FP8 call")
    if {spec.q_dtype, spec.k_dtype, spec.v_dtype} != {"float8_e4m3fn"}:
        raise ValueError(f"FP8 backward kernel operands are e4m3 only (got q/k/v "
                         f"{spec.q_dtype}, {spec.k_dtype}, {spec.v_dtype})")
    ok, why = fp8_bwd_can_implement(dtype=problem.dtype, head_dim=problem.head_dim,
                                    head_dim_v=problem.head_dim_v, do_dtype=spec.do_dtype,
                                    features=tuple(f for f in problem.features() if f != "fp8"))
    if not ok:
        raise ValueError(why)
    if problem.statics.deterministic:
        raise ValueError("deterministic FP8 backward: not implemented (dQ adds are unordered)")
    cfg = Fp8BwdConfig(do_dtype=spec.do_dtype, **_common_fields(problem, alibi=False))
    for name, block, length, tile in (("q", spec.q_block, problem.q_len, cfg.tile_m),
                                      ("k", spec.k_block, problem.kv_len, cfg.tile_n),
                                      ("v", spec.v_block, problem.kv_len, cfg.tile_n)):
        if block < length and block % tile:
            raise ValueError(f"{name} scales per {block}-row block: the FP8 backward kernel "
                             f"needs blocks of a multiple of {tile} rows (its tiles)")
    return cfg


def mod_schedule(head_dim: int, kv_len: int, causal: bool, score_mod: bool) -> dict:
    """A mod call's forward schedule: the plain call's pick on 128-row tiles (the mods'
    variants run there; a score_mod is treated as softcap, whose registers it needs too),
    else the default grid. Not yet measured on the H200: the first guess, to be tuned."""
    sched = schedule_for(head_dim, kv_len, causal, plain=True, softcap=score_mod)
    if sched.get("tile_m", 128) != 128:
        sched = {"mask_select": True} if causal else {}
    return sched


def sm100_forward_config(problem) -> Sm100FwdConfig:
    """The sm_100a forward variant for a problem (ValueError if none can). Nothing is measured
    on Blackwell yet: the per-head-dim defaults of `Sm100FwdConfig` (FlashAttention-4's
    rescale threshold 8, a quarter of the exp2 pairs on the FMA pipes)."""
    _nonempty(problem)
    _implementable(problem, sm100_can_implement)
    return Sm100FwdConfig(**_common_fields(problem))


def sm100_backward_config(problem) -> Sm100BwdConfig:
    """The sm_100a backward variant for a problem (ValueError if none can). Nothing is
    measured on Blackwell yet: the config's defaults (1-CTA, 128 x 128 tiles, Q / dO stages
    as shared memory allows; at head dim 256 the first of its two passes, whose `passes()`
    the launch side runs)."""
    _nonempty(problem, keys=True)
    if problem.mods is not None:
        raise ValueError("score / mask mods are not implemented in the sm_100a backward")
    _implementable(problem, sm100_bwd_can_implement)
    return Sm100BwdConfig(**_common_fields(problem),
                          deterministic=problem.statics.deterministic)


def sm100_fp8_forward_config(problem) -> Sm100Fp8FwdConfig:
    """The sm_100a FP8 forward variant for an FP8 problem (ValueError if none can): the same
    call rules as Hopper's FP8 forward (e4m3 operands, 16-bit output, scales per (batch,
    head) or per 128 rows, its features), on the sm100 forward's per-head-dim defaults.
    Nothing is measured on Blackwell yet."""
    hopper = fp8_forward_config(problem)
    return Sm100Fp8FwdConfig(out_dtype=hopper.out_dtype, q_blocks=hopper.q_blocks,
                             k_blocks=hopper.k_blocks, v_blocks=hopper.v_blocks,
                             **_common_fields(problem, alibi=False))


def schedule_for(head_dim: int, kv_len: int, causal: bool, plain: bool = True,
                 softcap: bool = False) -> dict:
    """Schedule fields that beat the default where measured (ratios to cuDNN's time, or
    TFLOP/s, default -> picked):

    - hd 64: 192 query rows (three consumer warpgroups; 1k 0.77 -> 0.90x, 16k 0.99 -> 1.16x),
      persistent where the key loop is short (S <= 1k, causal S <= 4k), so a tile's loads run
      under the previous tile's epilogue (causal 1k 0.75 -> 0.87x; it lost at 4k dense, 16k).
    - hd 64 dense, S <= 2k: 256 rows (four warpgroups at 112 registers, 64-key stages,
      persistent with the tile pipe) and `mask_skip`: no partial tile at 1k / 2k (1k 0.97 ->
      1.12x); it lost at 4k, 16k and causal.
    - causal hd 64 / 128, S <= 1k, no softcap: 64-row tiles at two CTAs per SM on the
      persistent loop with paired tiles: one CTA's tile start and epilogue run under the
      other's key loop (hd 128 386 -> 410 TFLOP/s; it lost at 4k and dense).
    - hd 128, S <= 1k: persistent with the tile pipe (the producer decodes the tiles; dense
      0.91 -> 1.03x) and the per-warpgroup epilogue (+1-2%).
    - causal hd 128 / 256 up to 4k, no softcap: the persistent loop taking a head's tiles in
      pairs (m with nm - 1 - m: every pair holds the same causal work; longest-first left the
      busiest SM 1.2x the mean, `devtools.sched_model`): hd 128 4k 1.07 -> 1.18x. It lost at
      16k and at hd 64.
    - hd 256 dense, S <= 4k: persistent with the tile pipe (4k 1.12 -> 1.22x; lost at 16k).
    - `lazy_rescale` above 8k keys at hd 64 dense and hd 256, no softcap (hd 256 16k dense
      1.09 -> 1.18x); it lost or was mixed at 1k / 4k and at hd 128.
    - `mask_skip` at dense hd 128 and hd 64 1k < S <= 8k (hd 128 1k 490 -> 568 TFLOP/s);
      `mask_select` on every causal call but the 192-row tiles, which always have it (hd 128
      4k 536 -> 582 TFLOP/s).

    Windows and key lengths get the same schedule; calls with ALiBi, segment ids or query
    lengths keep the default (``plain=False``). Crossing a threshold picks another variant (one
    more compile), nothing else does.
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
    _nonempty(problem, keys=True)
    st = problem.statics
    tail = use_tail_lpt(problem)
    _implementable(problem, bwd_can_implement)
    mods = spec_texts(problem.mods)
    if mods:
        return mod_backward_config(problem, mods)
    return BwdConfig(**_common_fields(problem), deterministic=st.deterministic,
                     tile_m=tile_m_for(problem.head_dim, st.softcap is not None,
                                       problem.has_alibi),
                     early_dv=use_early_dv(problem.head_dim, st.softcap is not None,
                                           st.deterministic),
                     dq_flat=use_dq_flat(problem.head_dim, st.softcap is not None,
                                         problem.has_alibi, problem.has_segments,
                                         (st.is_causal and not tail) or st.window is not None),
                     tail_lpt=tail, q_multicast=use_q_multicast(problem))


def mod_backward_config(problem, mods: dict) -> BwdConfig:
    """A mod call's backward: the plain call's choices with a score_mod treated as softcap
    (its derivative takes softcap's registers: 64-query steps, no early_dv above hd 96, no
    dq_flat at hd 128) and a mask_mod as a mask; no tail_lpt / q_multicast (not checked with
    mods). Not yet measured on the H200."""
    st = problem.statics
    sc = bool(mods["score"]) or st.softcap is not None
    masked = st.is_causal or st.window is not None or bool(mods["mask"])
    return BwdConfig(**_common_fields(problem), deterministic=st.deterministic,
                     tile_m=tile_m_for(problem.head_dim, sc, problem.has_alibi),
                     early_dv=use_early_dv(problem.head_dim, sc, st.deterministic),
                     dq_flat=use_dq_flat(problem.head_dim, sc, problem.has_alibi,
                                         problem.has_segments, masked),
                     score_mod=mods["score_grad"], mask_mod=mods["mask"])


def use_q_multicast(problem) -> bool:
    """q_multicast (key blocks 2j / 2j + 1 as a cluster, Q / dO halves multicast to both) on
    plain dense hd 256 calls with at least 4k keys: the step there is L2-bound (83% of peak in
    Nsight Compute), and halving the Q / dO reads took fwd+bwd from 4.15 to 3.93 ms at 4k. At
    1k it was slower, and on causal calls 1-6% behind `tail_lpt` (the pair waits on its slower
    CTA)."""
    st = problem.statics
    return (problem.head_dim == 256 and not st.is_causal and st.window is None
            and st.softcap is None and not st.deterministic and not problem.has_segments
            and problem.kv_len >= 4096)


def use_tail_lpt(problem) -> bool:
    """tail_lpt (the last heads' CTAs launched key-block-major, so the causal grid does not end
    on long CTAs; `bwd_order`) on plain causal calls (lengths allowed), not deterministic: the
    backward 0.5-5% faster at every causal point of two benches. Not with windows, softcap,
    ALiBi or segment ids (not checked with them)."""
    st = problem.statics
    return (st.is_causal and st.window is None and st.softcap is None and not st.deterministic
            and not problem.has_alibi and not problem.has_segments)


def use_dq_flat(head_dim: int, softcap: bool, alibi: bool, segments: bool,
                masked: bool) -> bool:
    """dq_flat (the dQ tile in fragment order, one bulk reduce per step; FA4's dQ path)
    wherever the step is 64 queries (backward alone hd 256 +6-10%, hd 128 +0-6%), and on hd 64's
    128-query step without a causal / window mask (+4-6%; with one it was slower, except beside
    `tail_lpt`). Not with ALiBi or segment ids (not checked with them), nor softcap at hd 128
    (ptxas spills 24 B)."""
    if alibi or segments or (softcap and head_dim == 128):
        return False
    return tile_m_for(head_dim, softcap, alibi) == 64 or not masked


def use_early_dv(head_dim: int, softcap: bool, deterministic: bool) -> bool:
    """early_dv where it was measured correct and faster: hd 128, fwd+bwd 1.00-1.04x the
    default. At hd 64 it was slower (0.95-0.96x); with softcap at hd 128 it spills (refused);
    with deterministic it was not run on the GPU, so it stays off there."""
    return head_dim == 128 and not softcap and not deterministic


def tile_m_for(head_dim: int, softcap: bool, alibi: bool) -> int:
    """128 queries per step where it is allowed (hd 64 without softcap / ALiBi: those spill):
    fwd+bwd 1.09-1.15x the 64-query step (backward alone 1.13-1.21x) on the dense and causal
    grid points."""
    if head_dim in TILE_M128_HEAD_DIMS and not softcap and not alibi:
        return 128
    return 64
