"""Static configuration of the Hopper forward kernel: one frozen, validated object per variant.

Everything here changes the compiled binary (it is part of the variant key); everything that does
not (batch, sequence lengths, scale, softcap value, window bounds, GQA ratio) is a runtime argument
of the kernel and deliberately absent.

Tile shapes follow the register and shared-memory budget of sm_90 with one producer warpgroup and
``tile_m // 64`` consumer warpgroups (2 by default: 128 query rows per CTA), 2 K/V stages and P
kept in registers for the PV GEMM (RS wgmma). Shared memory = Q + stages * (K + V) (O reuses
Q's buffer), which must stay under the 227 KB a CTA may use.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from jaxflash.kernels.variants.mod_program import digest, mod_aux

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 227 * 1024
SMEM_PER_SM_BYTES = 228 * 1024
# Longest-first tile order walks heads in sections whose K/V fit this much L2 (another size was
# within noise where measured).
L2_SECTION_MB = 24
# Runtime scalars of a launch (`jaxflash.ffi` Launch.scalars / int_scalars), in tensor order.
FLOAT_SCALARS = ("softmax_scale", "softcap")
INT_SCALARS = ("window_left", "window_right")
# Per head dim: (tile_m, tile_n). hdim 64/96/128: 128x128. 192: 128x112 and 256: 128x80 keep
# Q + 2 K + 2 V stages inside the shared-memory limit (O reuses Q), and the 64 x hdim fp32
# O accumulator + 64 x tile_n S accumulator inside 240 registers per consumer thread.
_TILES = {64: (128, 128), 96: (128, 128), 128: (128, 128), 192: (128, 112), 256: (128, 80)}
# With a causal/window mask, hdim 256 at tile_n 80 makes ptxas serialize the wgmma ("insufficient
# register resources", C7512); tile_n 64 frees the 12 registers that avoids it.
_TILES_MASKED = {256: (128, 64)}
# The segment-id element compare (one id load per column a thread owns) costs more registers
# still: measured with ptxas, hdim 192 needs tile_n 80 (96 serializes once causal + ALiBi join)
# and hdim 256 tile_n 64.
_TILES_SEGMENTS = {192: (128, 80), 256: (128, 64)}


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """One compiled variant of `FlashFwdSm90`.

    dtype: "bfloat16" or "float16" (q, k, v and o share it; lse is float32).
    head_dim / head_dim_v: H and Hv (equal; Hv != H is refused for now).
    is_causal: top-left aligned causal mask (key j visible to query i iff j <= i).
    has_window: a (left, right) sliding window, bounds given at run time.
    has_softcap: logits -> softcap * tanh(logits / softcap), softcap given at run time.
    has_q_seqlen / has_kv_seqlen: per-batch valid lengths given as [B] int32 arrays.
    has_alibi: logits -= slope[n] * |i - j| (after softcap), slopes a runtime [1, N] float32
      tensor (new values never recompile).
    has_segments: keep (i, j) iff q_segment_ids[b, i] == kv_segment_ids[b, j]; key blocks whose
      segments cannot meet the query tile's are skipped (per-block summaries computed in XLA by
      `jaxflash.kernels.common.segments`).
    tile_m, tile_n, num_stages: CTA tile and K/V pipeline depth (None: the per-head-dim default).
      tile_m is 64 per consumer warpgroup: 128 (the default), 192 and 256 at head dim 64, 64
      with two CTAs per SM. Every consumer warpgroup overlaps the softmax of key block j with
      the PV GEMM of block j-1 (FA3 Alg. 2), and two warpgroups up to hd 128 take turns at the
      tensor cores (pingpong, FA3 sec. 3.1).
    ctas_per_sm: 2 with tile_m 64 (and only then): one consumer warpgroup per CTA, two CTAs
      resident per SM (128 registers per thread at launch, setmaxnreg 24 / 232; shared memory
      at most half the SM's), so one CTA's tile start and epilogue run under the other's key
      loop instead of a warpgroup waiting at the tile boundary. The persistent grid is two CTAs
      per SM.
    persistent: one CTA per SM loops over tiles, so a tile's loads overlap the previous tile's
      epilogue (and causal tiles are dealt longest-first in a balanced order).
    tile_pipe: persistent only: the producer warp (idle while its loads fly) decodes each tile
      and hands (m_block, head, batch) to the consumers through a 2-slot shared-memory
      pipeline, so the consumers' tile loop carries no scheduler state and does no index
      division per tile (`sm90.tile_handoff`).
    wg_epilogue: (persistent, O in its own buffer) each consumer warpgroup normalizes, stores
      (stmatrix, then a TMA store of its own 64 rows issued by its first warp) and leaves its
      half of the tile on its own, with a 128-thread barrier instead of the two 256-thread
      ones: under pingpong the second warpgroup runs about half a key block behind the
      first, which otherwise waits for it at every tile's end.
    lazy_rescale: skip the output rescale (64 FMULs per thread and block) when no row of the
      warp raised its running max, through a warp-uniform branch (`OnlineSoftmax.step_lazy`;
      FlashAttention-4's conditional rescaling with threshold 0, so the results are bitwise
      those without it). The branch also lets ptxas keep most of the exp2 under the PV GEMM.
    tile_order: "auto" (longest-first for causal / window, heads in sections whose K/V fit
      ``L2_SECTION_MB`` of L2; natural otherwise) or "pairs" (persistent with tile_pipe,
      causal / window: tile m with tile nm - 1 - m of the same head on one CTA, pairs dealt
      round-robin; `scheduler.TileScheduler`).
    mask_skip: where only the key length can cut a block (no causal / window bound), test once
      per block, warp-uniformly, whether the block reaches past the key length and skip the
      per-element compare when it does not. Every tile's first (rightmost) block is masked on
      its exposed path (the QK waits to completion there), so at S = 1k dense this is one
      compare per score on one block in eight.
    mask_select: mask a block with one select per score (`mask.apply_mask(by_select=True)`)
      instead of conditional stores, which ptxas turns into a cascade of ~14 selects per score
      (909 FSEL in one masked hd 128 block): every causal tile's diagonal block pays it. Always
      on at tile_m 192 (its registers need it); a flag for the other tiles, whose binaries
      without it are the dense and non-causal picks.
    score_mod / mask_mod: a user mod as its canonical program text (`mod_program`; "" for
      none). score_mod rewrites each scaled logit in registers (the softmax then runs in
      natural-log units); mask_mod is evaluated only on the partial blocks of a per-tile block
      range table computed in XLA from the same mod (`jaxflash.kernels.mod_blocks`): empty
      blocks are never loaded, full ones run unmasked. Aux arrays are inputs of fixed shape.
    """

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: Optional[int] = None
    is_causal: bool = False
    has_window: bool = False
    has_softcap: bool = False
    has_q_seqlen: bool = False
    has_kv_seqlen: bool = False
    has_alibi: bool = False
    has_segments: bool = False
    tile_m: Optional[int] = None
    tile_n: Optional[int] = None
    num_stages: int = 2
    ctas_per_sm: int = 1
    persistent: bool = False
    tile_pipe: bool = False
    wg_epilogue: bool = False
    lazy_rescale: bool = False
    tile_order: str = "auto"
    mask_skip: bool = False
    mask_select: bool = False
    score_mod: str = ""
    mask_mod: str = ""

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        default = _TILES.get(self.head_dim, (128, 128))
        if self.is_causal or self.has_window:
            default = _TILES_MASKED.get(self.head_dim, default)
        if self.has_segments:
            default = _TILES_SEGMENTS.get(self.head_dim, default)
        if self.tile_m is None:
            object.__setattr__(self, "tile_m", default[0])
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", default[1])
        ok, why = self.check()
        if not ok:
            raise ValueError(f"FwdConfig: {why}")

    # -- validation ------------------------------------------------------------------------
    def check(self) -> tuple[bool, str]:
        """(True, "") when this variant can be built, else (False, reason)."""
        if self.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {self.dtype} not in {SUPPORTED_DTYPES}"
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        if self.tile_m not in (64, 128, 192, 256):
            return False, (f"tile_m {self.tile_m} must be 64, 128, 192 or 256 (one to four "
                           "64-row consumer warpgroups)")
        if (self.ctas_per_sm == 2) != (self.tile_m == 64) or self.ctas_per_sm not in (1, 2):
            return False, (f"ctas_per_sm {self.ctas_per_sm} with tile_m {self.tile_m}: 64-row "
                           "tiles run two CTAs per SM (one warpgroup each), the others one")
        if self.ctas_per_sm == 2 and self.head_dim > 128:
            # ptxas C7602 at hd 256: the PV wgmma (64 x 256 float32 accumulator, 128 registers
            # a thread) cannot be compiled under the 128-register launch bound
            return False, (f"ctas_per_sm 2 only up to head_dim 128 (head_dim {self.head_dim}: "
                           "the PV wgmma needs more than the 128-register launch bound)")
        if self.tile_m == 192 and self.head_dim > 64:
            return False, f"tile_m 192 (160 registers per thread) only for head_dim <= 64"
        if self.tile_m == 256 and (self.head_dim > 64 or self.tile_n > 64 or self.has_softcap):
            return False, ("tile_m 256 (four consumer warpgroups at 112 registers) only at "
                           f"head_dim 64 with tile_n <= 64, no softcap (head_dim "
                           f"{self.head_dim}, tile_n {self.tile_n})")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            return False, f"tile_n {self.tile_n} must be a multiple of 16 in [16, 256]"
        if self.mask_select and self.tile_m == 192:
            return False, ("mask_select is always on at tile_m 192 (drop the flag: the key "
                           "would name a second copy of one binary)")
        if self.score_mod or self.mask_mod:
            ok, why = self._check_mods()
            if not ok:
                return False, why
        if self.tile_order not in ("auto", "pairs"):
            return False, f"tile_order {self.tile_order!r} not in ('auto', 'pairs')"
        if self.tile_order == "pairs" and not (self.tile_pipe
                                               and (self.is_causal or self.has_window)):
            return False, ("tile_order 'pairs' needs tile_pipe=True (the producer skips empty "
                           "slots; the consumers see only real tiles) and a causal or window "
                           "mask (without one every tile costs the same)")
        if self.wg_epilogue and not (self.persistent and self.separate_o):
            return False, ("wg_epilogue needs persistent=True with O in its own shared buffer "
                           "(head dims <= 128): each warpgroup then stores its own rows and "
                           "goes on to the next tile")
        if self.tile_pipe and not self.persistent:
            return False, "tile_pipe needs persistent=True (it feeds the persistent tile loop)"
        if self.num_stages < 1 or self.num_stages > 4:
            return False, f"num_stages {self.num_stages} must be in [1, 4]"
        if self.smem_bytes() > self.smem_limit:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {self.smem_limit} B "
                           f"(tile {self.tile_m}x{self.tile_n}, {self.num_stages} stages)")
        return True, ""

    def _check_mods(self) -> tuple[bool, str]:
        if self.has_softcap or self.has_alibi or self.has_segments:
            return False, ("a score / mask mod with the built-in softcap, ALiBi or segment ids "
                           "(write them as mods)")
        if self.tile_m != 128:
            return False, f"mods run on 128-row tiles (tile_m {self.tile_m})"
        if self.score_mod and self.mask_mod and mod_aux(self.score_mod) != mod_aux(
                self.mask_mod):
            return False, "score_mod and mask_mod must take the same aux arrays"
        return True, ""

    @property
    def aux(self) -> tuple:
        """(dtype, shape) of the mods' aux arrays (kernel inputs of fixed shape)."""
        return mod_aux(self.score_mod or self.mask_mod)

    def smem_bytes(self, separate_o: Optional[bool] = None) -> int:
        elt = 2
        q = self.tile_m * self.head_dim * elt
        o = self.tile_m * self.head_dim_v * elt
        kv = self.num_stages * self.tile_n * (self.head_dim + self.head_dim_v) * elt
        sep = self.separate_o if separate_o is None else separate_o
        return (q + o if sep else max(q, o)) + kv + 1024  # + barriers and alignment

    @property
    def separate_o(self) -> bool:
        """O gets its own shared buffer (instead of Q's) when persistent and it fits: the next
        tile's Q then loads while this tile's epilogue runs."""
        return self.persistent and self.smem_bytes(separate_o=True) <= self.smem_limit

    @property
    def smem_limit(self) -> int:
        """Shared memory one CTA may use: all of it, or with two CTAs per SM half the SM's
        228 KB less the 1 KB the hardware reserves per CTA."""
        return SMEM_LIMIT_BYTES if self.ctas_per_sm == 1 else SMEM_PER_SM_BYTES // 2 - 1024

    @property
    def lpt(self) -> bool:
        """Whether tiles go longest-first (their cost varies with m under a right bound, or
        may under a mask_mod)."""
        return self.tile_order == "auto" and (self.is_causal or self.has_window
                                              or bool(self.mask_mod))

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def key(self) -> str:
        """Stable, readable variant key (changes iff the binary changes)."""
        feats = [n for n, on in (("causal", self.is_causal), ("window", self.has_window),
                                 ("softcap", self.has_softcap), ("qlen", self.has_q_seqlen),
                                 ("kvlen", self.has_kv_seqlen), ("alibi", self.has_alibi),
                                 ("seg", self.has_segments)) if on]
        # "ovpp": intra-warpgroup overlap and pingpong, which every variant has (the names stay
        # so keys, and the result files that cite them, stay stable)
        sched = ("ovpp" + ("ps" if self.persistent else "") + ("tp" if self.tile_pipe else "")
                 + ("we" if self.wg_epilogue else "") + ("lz" if self.lazy_rescale else ""))
        if self.lpt:
            sched += f"_lpt{L2_SECTION_MB}"
        if self.tile_order == "pairs":
            sched += "_pairs"
        if self.ctas_per_sm != 1:
            sched += f"_c{self.ctas_per_sm}"
        if self.mask_skip:
            sched += "_msk"
        if self.mask_select:
            sched += "_sel"
        mods = ""
        if self.score_mod or self.mask_mod:
            mods = (f"_{'s' if self.score_mod else ''}{'m' if self.mask_mod else ''}mod"
                    f"{digest(self.score_mod, self.mask_mod)}")
        return (f"fwd_sm90_{self.dtype}_h{self.head_dim}_hv{self.head_dim_v}"
                f"_t{self.tile_m}x{self.tile_n}s{self.num_stages}_{sched}"
                f"_{'-'.join(feats) or 'dense'}{mods}")


def can_implement(config: FwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the Hopper forward kernel serves a problem.

    Pass either a `FwdConfig` or keyword facts: dtype, head_dim, head_dim_v, features (a tuple
    of `jaxflash._types.Problem.features()` names). Returns (ok, reason-if-not).
    """
    if config is not None:
        return config.check()
    dtype = problem.get("dtype")
    if dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {dtype} not supported (only {SUPPORTED_DTYPES})"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} not supported (only {SUPPORTED_HEAD_DIMS})"
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    unsupported = [f for f in problem.get("features", ())
                   if f not in ("causal", "window", "softcap", "seq_lengths", "alibi",
                                "segment_ids", "score_mod", "mask_mod", "block_mask")]
    if unsupported:
        return False, f"features {unsupported} not supported by the Hopper forward kernel yet"
    return True, ""
