"""Static configuration of the Hopper backward kernel (`sm90.bwd.FlashBwdSm90`); DSL-free.

Like `variants.fwd` for the forward: everything here changes the binary (it is part of the
variant key); batch, lengths, head counts, scale, softcap and window values are runtime arguments.

Tile: ``tile_n`` = 128 keys per CTA (two consumer warpgroups of 64 key rows each) and
``tile_m`` = 64 queries per step of the CTA's loop (128 at hd 64: `choose.tile_m_for`). Per
consumer thread the registers hold the dK and dV accumulators (64 x hd / 128 threads each:
hd/2 + hdv/2 floats) plus the 64 x 64 S^T and dP^T tiles (32 + 32 floats): 192 at hd 128,
inside the 240 that setmaxnreg gives. hd 192 and 256 do not fit that budget at 64 keys per
warpgroup: they run `sm90.bwd_wide` instead (``split == "headdim"``): ``tile_n`` = 64 keys,
the two warpgroups split the head dim of dK, dV and dQ (hd/4 + hd/4 floats + hd/4 for dQ per
thread, P^T / dS^T through shared memory). Its shared memory: at hd 256 the float32 dQ tile
(64 KB) leaves room for one Q / dO stage (``num_stages`` defaults to the most, up to 2, that
fits).

Shared memory: K and V (tile_n x hd, loaded once), Q and dO (tile_m x hd, ``num_stages``), dS^T
(tile_n x tile_m, 2 buffers: the dQ GEMM of step i reads one while step i+1 writes the other),
LSE / delta rows (tile_m floats per stage) and the float32 dQ tile that the TMA reduce-add
reads.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from jaxflash.kernels.variants.mod_program import digest, mod_aux

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# Head dims above this run `sm90.bwd_wide.FlashBwdSm90Wide` (tile_n 64, head dim split).
KEY_SPLIT_MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 227 * 1024
FEATURES = ("causal", "window", "softcap", "seq_lengths", "alibi", "segment_ids", "score_mod",
            "mask_mod", "block_mask")
# Per consumer warp partial sums of d(alibi slope) (see `sm90.bwd`): [B, N, n blocks, 8].
ALIBI_PARTS = 8
# Runtime scalars, in tensor order (same names and meaning as the forward's).
FLOAT_SCALARS = ("softmax_scale", "softcap")
INT_SCALARS = ("window_left", "window_right")
# LSE and delta are passed padded to a multiple of this many queries (TMA boxes of tile_m rows
# need 16-byte aligned row strides; padding rows carry LSE = +inf so they contribute nothing).
# A config with another tile_m pads to lcm(LSE_PAD, tile_m) (`bwd_launch.padded_len`): 128 at
# tile_m 128.
LSE_PAD = 64
# Head dims that may take tile_m 128 (see `BwdConfig`): hd 96 (64 + 64 + 48 + 48 accumulator
# registers per thread for S^T, dP^T, dK and dV) spills 388 bytes and serializes the wgmma
# (ptxas); hd 128 would need 256.
TILE_M128_HEAD_DIMS = (64,)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """One compiled variant of `FlashBwdSm90`.

    dtype: "bfloat16" or "float16" (q, k, v, do, dk, dv share it; dq accumulates in float32).
    head_dim / head_dim_v: H and Hv (equal).
    is_causal / has_window / has_softcap / has_q_seqlen / has_kv_seqlen: as in `FwdConfig`.
    tile_m: queries per inner step: 64 (one wgmma M atom for the dQ GEMM; the field's default) or
      128 (``TILE_M128_HEAD_DIMS`` only; what `choose.backward_config` picks there): S^T
      and dP^T are then 64 keys x 128 queries per warpgroup (64 + 64 floats per thread,
      + hd/2 + hd/2 for dK and dV: 192 at hd 64, as hd 128 at tile_m 64), half as many steps
      (barriers, LSE / delta reads, dQ reduce-adds per query) and the dQ GEMM splits its 128
      query rows over the warpgroups (64 rows x hd each) instead of the head dim. Q / dO
      stages, TMA boxes, dS^T buffers, the float32 dQ tile, the query-block ranges, the
      deterministic semaphores ([B, N, ceil(T / tile_m)]) and the segment block summaries all
      follow tile_m.
    tile_n: keys per CTA (64 per consumer warpgroup).
    num_stages: pipeline depth of the Q / dO (+ LSE / delta) loads.
    A step's tile_m x hd dQ partial reaches the float32 accumulator in global memory through
      shared memory and one TMA reduce-add (cp.reduce.async.bulk.tensor) per step: the add
      happens in L2, no per-element instructions (the key says "dqtma").
    deterministic: bitwise-reproducible dQ: the CTAs add into a query block in key-block order
      (a per-(batch, head, query block) semaphore in global memory). dK/dV never use atomics,
      so they are deterministic in either mode.
    has_alibi / has_segments: as in `FwdConfig` (slopes [1, N], ids and block summaries with
      rows = keys, columns = queries); ALiBi also writes per-warp partial sums of
      sum_ij dS_ij |i - j| (``ALIBI_PARTS`` per (batch, head, key block)) that the caller
      reduces in XLA into d(slopes) (no atomics: deterministic).
    dq_flat: FA4's dQ path: each consumer thread stores its dQ fragment to shared memory in
      fragment order (16-byte vector stores, conflict-free) and warp 4 adds the whole tile with
      one flat bulk reduce (cp.reduce.async.bulk .add.f32, tile_m x hd x 4 bytes) into a
      fragment-ordered accumulator [B, N, ceil(T / tile_m), tile_m x hd] that the caller
      un-permutes in XLA (`bwd_launch.dq_from_flat`, fused with the scale and cast), instead of
      hd / 32 TMA tensor boxes of tile_m x 128 B per step (4 at hd 128, 8 at hd 256), or at
      tile_m 128 hd / 8 boxes of 128 x 32 B. Both kernels.
    tail_lpt: (causal) launch the last heads' CTAs key-block-major, longest first, so the final
      wave ends with short CTAs (`jaxflash.kernels.sm90.bwd_order`).
    early_dv: compute P^T as soon as S^T is ready (while the dP^T GEMM still runs) and issue
      dV += P^T dO before forming dS^T (whose arithmetic then runs behind the dV GEMM), instead
      of waiting for both GEMMs and doing all the elementwise work with the tensor cores idle.
      With softcap the tanh values are kept for dS^T (32 more registers): hd <= 96 there.
    q_multicast: (not deterministic, window or segment ids) key blocks 2j and 2j+1 of one
      (head, batch) run as a cluster of two CTAs walking the same query blocks (those of block
      2j: under causal masking block 2j+1's first one is fully masked), and each CTA loads half
      of every Q and dO tile by TMA multicast into both CTAs' shared memory
      (`jaxflash.kernels.sm90.q_multicast`): half the Q / dO bytes read from L2, where the
      hd 256 kernel waits (Nsight Compute: L2 at 83% of peak). The pair's stage release is
      coupled: a stage is refilled once both CTAs' consumers have released it.
    score_mod: the score mod's program with two outputs, its value and its derivative by the
      score (`mod_program.score_program(with_grad=True)`): P^T comes from the value, dS^T is
      multiplied by the derivative (folded into dP^T as it is formed). mask_mod: as in
      `FwdConfig`, with the table's rows = key blocks (`mod_blocks.backward_table`); with
      ``deterministic`` the range is not narrowed (the dQ order counts every key block), only
      the full blocks skip the mask. Key-split kernel (hd <= 128) only.
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
    tile_m: int = 64
    tile_n: Optional[int] = None
    num_stages: Optional[int] = None
    deterministic: bool = False
    early_dv: bool = False
    dq_flat: bool = False
    tail_lpt: bool = False
    q_multicast: bool = False
    score_mod: str = ""
    mask_mod: str = ""

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        wide = self.head_dim > KEY_SPLIT_MAX_HEAD_DIM
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", 64 if wide else 128)
        if self.num_stages is None:
            # 2 (prefetch the next step's Q / dO) where the shared memory allows, else 1: at
            # hd 256 the float32 dQ tile (64 KB) leaves room for one stage.
            object.__setattr__(self, "num_stages", 2)
            if self.smem_bytes() > SMEM_LIMIT_BYTES:
                object.__setattr__(self, "num_stages", 1)
        ok, why = self.check()
        if not ok:
            raise ValueError(f"BwdConfig: {why}")

    def check(self) -> tuple[bool, str]:
        if self.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {self.dtype} not in {SUPPORTED_DTYPES}"
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, (f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS} (the dK/dV "
                           "accumulators of larger head dims do not fit the registers)")
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        if self.tile_m not in (64, 128):
            return False, f"tile_m {self.tile_m} must be 64 or 128 (wgmma M atoms of dQ)"
        if self.tile_m == 128 and self.head_dim not in TILE_M128_HEAD_DIMS:
            return False, (f"tile_m 128 at head_dim {self.head_dim}: the 64 x 128 S^T and dP^T "
                           "tiles beside the dK / dV accumulators exceed the 240 registers "
                           f"(head dims {TILE_M128_HEAD_DIMS})")
        if self.tile_m == 128:
            # Measured with ptxas at hd 64: each of these adds live registers to the 192
            # accumulators (tanh kept, bias and d(slope), P^T early).
            extra = [n for n, on in (("softcap", self.has_softcap), ("alibi", self.has_alibi),
                                     ("early_dv", self.early_dv)) if on]
            if extra:
                return False, (f"tile_m 128 with {', '.join(extra)}: ptxas spills or "
                               "serializes the wgmma (softcap 68 B, ALiBi 276 B of spills; "
                               "early_dv C7512)")
        if self.head_dim <= KEY_SPLIT_MAX_HEAD_DIM and self.tile_n != 128:
            return False, f"tile_n {self.tile_n} must be 128 (two 64-key consumer warpgroups)"
        if self.head_dim > KEY_SPLIT_MAX_HEAD_DIM:
            if self.tile_n != 64:
                return False, (f"tile_n {self.tile_n} must be 64 at head_dim {self.head_dim} "
                               "(the two consumer warpgroups split the head dim)")
            if self.early_dv:
                return False, (f"early_dv at head_dim {self.head_dim}: a schedule of the "
                               "key-split kernel only (hd <= 128)")
        if self.q_multicast:
            extra = [n for n, on in (
                ("window", self.has_window), ("segment ids", self.has_segments),
                ("deterministic", self.deterministic)) if on]
            if extra:
                return False, (f"q_multicast with {', '.join(extra)}: the paired CTAs walk the "
                               "even key block's query blocks (a window's end, segment ranges "
                               "or ordered dQ adds would differ between the two)")
        if self.tail_lpt and not self.is_causal:
            return False, "tail_lpt only with is_causal (key blocks cost the same otherwise)"
        if self.early_dv and self.has_softcap and self.head_dim > 96:
            return False, (f"early_dv with softcap at head_dim {self.head_dim}: the tanh values "
                           "kept for dS^T make ptxas spill (hd <= 96)")
        if self.has_alibi and self.head_dim > 96:
            return False, (f"ALiBi at head_dim {self.head_dim}: the bias and d(slope) "
                           "registers make ptxas spill or serialize the wgmma (hd <= 96)")
        if self.has_segments and self.head_dim > KEY_SPLIT_MAX_HEAD_DIM:
            return False, (f"segment ids at head_dim {self.head_dim}: the head-dim-split kernel "
                           "(FlashBwdSm90Wide) does not implement them yet")
        if self.has_alibi and self.has_softcap:
            return False, ("ALiBi with softcap: the backward keeps tanh in the S^T registers "
                           "for the softcap derivative, which the ALiBi bias would overwrite")
        if self.has_segments and self.deterministic:
            return False, ("deterministic with segment ids: the key-block order of the dQ adds "
                           "assumes the geometric block ranges, which segment skipping changes")
        if self.score_mod or self.mask_mod:
            ok, why = self._check_mods()
            if not ok:
                return False, why
        if not 1 <= self.num_stages <= 3:
            return False, f"num_stages {self.num_stages} must be in [1, 3]"
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B "
                           f"(head_dim {self.head_dim}, {self.num_stages} stages)")
        return True, ""

    def _check_mods(self) -> tuple[bool, str]:
        if self.has_softcap or self.has_alibi or self.has_segments:
            return False, ("a score / mask mod with the built-in softcap, ALiBi or segment ids "
                           "(write them as mods)")
        if self.split != "keys" or self.q_multicast:
            return False, (f"mods in the key-split backward only (head_dim {self.head_dim} "
                           "<= 128, no q_multicast)")
        if self.score_mod and (self.tile_m != 64 or self.early_dv):
            return False, ("a score_mod folds its derivative into dP^T once that GEMM is done "
                           "(registers as softcap's): tile_m 64, no early_dv")
        if self.score_mod and self.mask_mod and mod_aux(self.score_mod) != mod_aux(
                self.mask_mod):
            return False, "score_mod and mask_mod must take the same aux arrays"
        return True, ""

    @property
    def aux(self) -> tuple:
        """(dtype, shape) of the mods' aux arrays (kernel inputs of fixed shape)."""
        return mod_aux(self.score_mod or self.mask_mod)

    def smem_bytes(self) -> int:
        elt = 2
        kv = self.tile_n * (self.head_dim + self.head_dim_v) * elt
        qdo = self.num_stages * self.tile_m * (self.head_dim + self.head_dim_v) * elt
        # dS^T, 2 buffers (key split); P^T and dS^T, one buffer each (head-dim split: the
        # flush's barrier of both warpgroups guards their reuse)
        ds = 2 * self.tile_n * self.tile_m * elt
        # LSE / delta rows: tile_m floats per stage, each stage a TMA destination (128-byte
        # aligned: tile_m is a multiple of 32)
        rows = 2 * self.num_stages * self.tile_m * 4
        dq = self.tile_m * self.head_dim * 4
        return kv + qdo + ds + rows + dq + 1024  # + barriers and alignment

    @property
    def split(self) -> str:
        """How the two consumer warpgroups share the work: "keys" (64 key rows each, hd <= 128)
        or "headdim" (hd / 2 columns of dK, dV and dQ each, hd 192 / 256)."""
        return "keys" if self.head_dim <= KEY_SPLIT_MAX_HEAD_DIM else "headdim"

    @property
    def num_mma_warpgroups(self) -> int:
        return 2

    @property
    def key(self) -> str:
        feats = [n for n, on in (("causal", self.is_causal), ("window", self.has_window),
                                 ("softcap", self.has_softcap), ("qlen", self.has_q_seqlen),
                                 ("kvlen", self.has_kv_seqlen),
                                 ("alibi", self.has_alibi), ("seg", self.has_segments)) if on]
        mods = ""
        if self.score_mod or self.mask_mod:
            mods = (f"_{'s' if self.score_mod else ''}{'m' if self.mask_mod else ''}mod"
                    f"{digest(self.score_mod, self.mask_mod)}")
        # "dqtma": the dQ path's name from when a second one existed; kept so keys (and the
        # result files that cite them) stay stable
        return (f"bwd_sm90_{self.dtype}_h{self.head_dim}_hv{self.head_dim_v}"
                f"_t{self.tile_m}x{self.tile_n}s{self.num_stages}_dqtma"
                f"{'_det' if self.deterministic else ''}{'_edv' if self.early_dv else ''}"
                f"{'_dqf' if self.dq_flat else ''}{'_tl' if self.tail_lpt else ''}"
                f"{'_qmc' if self.q_multicast else ''}"
                f"_{'-'.join(feats) or 'dense'}{mods}")


def can_implement(config: BwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the Hopper backward kernel serves a problem: a `BwdConfig`, or keyword facts
    dtype, head_dim, head_dim_v, features."""
    if config is not None:
        return config.check()
    dtype = problem.get("dtype")
    if dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {dtype} not supported (only {SUPPORTED_DTYPES})"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, (f"head dim {hd} not supported by the CuTe backward (only "
                       f"{SUPPORTED_HEAD_DIMS})")
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    unsupported = [f for f in problem.get("features", ()) if f not in FEATURES]
    if unsupported:
        return False, f"features {unsupported} not supported by the Hopper backward kernel yet"
    return True, ""
