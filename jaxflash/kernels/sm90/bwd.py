"""FlashAttention backward for Hopper (sm_90a) in the CuTe DSL: `FlashBwdSm90`.

Shape of the kernel (the FA2/FA3 backward scheme, written here from the papers):

- One CTA per (key block n, kv head, batch): ``tile_n`` = 128 keys, split over 2 consumer
  warpgroups of 64 key rows, plus 1 producer warpgroup (setmaxnreg 24 / 240). K and V of the
  block are loaded once (TMA) and stay in shared memory. The CTA loops over the query heads of
  its GQA group and, for each, over the query blocks m (``tile_m`` = 64, or 128 at hd 64)
  that can see the key block (`mask.QueryBlockRange`), so dK and dV are summed over the group
  in registers: no atomics for them and no K/V copies.
- Producer: warp 0 issues TMA loads of Q with its LSE row slice and dO with its delta slice
  (``num_stages`` each), in the consumers' order.
- Consumers, per step, with the keys as the wgmma M dimension ("swapAB", so every operand is in
  a legal major-ness with no register transposes):
    S^T  = K Q^T                (A = K smem, B = Q smem, both K-major)
    dP^T = V dO^T               (A = V smem, B = dO smem)
    P^T  = exp2(S^T * scale * log2e - lse2)      per column (query) lse2 from shared memory
    dS^T = P^T * (dP^T - delta)  (times 1 - tanh^2 under softcap)
    dV  += P^T dO               (A = P^T from registers, B = dO^T: MN-major smem view)
    dK  += dS^T Q               (A = dS^T from registers, B = Q^T: MN-major smem view)
    dQ_m = dS K                 (dS^T written to smem with stmatrix; A = its transposed view,
                                 B = K^T; the tile_m x hd tile is split over the two
                                 warpgroups by columns at tile_m 64, by 64-query rows at
                                 tile_m 128) then added to the float32 dQ accumulator in global
                                 memory (other CTAs add to the same rows): staged in shared
                                 memory and added by TMA reduce-adds (one per 8-column slab
                                 at tile_m 128), or with ``dq_flat`` one flat bulk reduce
- Epilogue: dK * scale and dV converted to the input dtype, written to shared memory (K's and
  V's buffers, free by then) with stmatrix and stored by TMA (which clips rows past S).

The host first zeroes dQ (same stream: no aliasing). `q_multicast`: CTAs in pairs (its module).

Deterministic mode: the dQ reduce-adds into a query block happen in key block order. A
semaphore per (batch, head, query block), zeroed with dQ, counts the key blocks done; CTA n
waits (one lane of warp 4 spinning on an acquire load) until it equals n - first (the lowest
key block visiting that query block: `QueryBlockRange.n_block_first`), adds, waits for the add
and releases n + 1. It only waits on lower n of its (kv head, batch), launched before it.

Masking (jax.nn semantics, `mask.py`): masked logits are -inf before the exponential (P = dS
= 0); queries with no visible key, past q_seqlen or T arrive with lse2 = +inf (P = 0, never
NaN); keys at or past kv_seqlen are masked in every step (dK / dV rows 0).

ALiBi and segment ids reuse the forward's blocks (`mask.py`) on the transposed tile (rows =
keys, columns = queries; |i - j| is symmetric, and `SegmentRows` / `apply_segment_mask` take
keys as rows). ALiBi: the slope (in S^T units: divided by the softmax scale) is subtracted
times |i - j| before the exponential; d(slope) = -sum dS_ij |i - j| (dS = dL/dlogit, before
the scale folded into dK) is accumulated per thread in float32 while dS^T is in registers,
reduced over the warp at the end of each query head and written by lane 0 to
alibi_parts[b, head, n_block, warp] (no atomics: deterministic; the caller sums and negates).
Segment ids: the CTA visits only the query blocks [first, end) that XLA precomputed from the
per-block (min, max) ids with rows = keys (`segments.block_summaries(kv_seg, q_seg, ...)`),
intersected with the causal/window/length range; a block pair whose ids are not one shared
segment gets the element compare (P = dS = 0 where the ids differ).
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.variants.bwd import FLOAT_SCALARS, INT_SCALARS, BwdConfig
from jaxflash.kernels.sm90.bwd_order import block_coords
from jaxflash.kernels.sm90.bwd_step_math import BwdStepMath
from jaxflash.kernels.sm90.dq_accum import DqAccumulation
from jaxflash.kernels.common.dq_order import zero_fill
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.mask import (QueryBlockRange, SegmentRows, TileCoords, apply_alibi,
                                   apply_mask_kq, apply_segment_mask)
from jaxflash.kernels.common.pipes import TmaPipelines
from jaxflash.kernels.sm90.q_multicast import QMulticast

LOG2_E = math.log2(math.e)

# Named barrier ids (0 is __syncthreads; 3 is `dq_accum.BAR_DQ`).
_BAR_DS = 1  # dS^T of a step is in shared memory (both consumer warpgroups wrote their half)
_BAR_EPILOGUE = 2
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class FlashBwdSm90(DqAccumulation, QMulticast, BwdStepMath):
    """Hopper backward attention kernel for one `BwdConfig` variant.

    Host entry (``@cute.jit __call__``), the bridge's order (see `bwd_launch`): q, k, v, do,
    lse2, delta, [q_seqlen], [kv_seqlen], dq_acc, dk, dv, fscalars, [iscalars], stream.
    """

    def __init__(self, config: BwdConfig):
        ok, why = config.check()
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = _DTYPES[config.dtype]
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        self.num_mma_wg = config.num_mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 * (self.num_mma_wg + 1)
        self.producer_regs, self.mma_regs = 24, 240
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window
        # `dq_flat`: the staging tile in fragment order, one bulk reduce (no TMA tensor map)
        self.dq_flat = config.dq_flat
        self.dq_box = not self.dq_flat
        # How the two warpgroups split the tile_m x hd dQ tile of a step: at tile_m 64 (one
        # wgmma M atom) by head-dim halves; at tile_m 128 by 64-query row halves, each with the
        # whole head dim: wgmma N = hd instead of hd/2 (half the instructions) and each
        # warpgroup reads only its queries' half of dS^T from shared memory.
        wgs = self.num_mma_wg
        self.dq_atoms = (1, wgs, 1) if config.tile_m == 64 else (wgs, 1, 1)
        self.dq_cols = self.hd // self.dq_atoms[1]  # dQ columns per warpgroup
        # The float32 dQ tile in shared memory: at tile_m 64, swizzled atoms, whole ones per
        # warpgroup part. At tile_m 128 the swizzle gives each thread 16 store addresses that
        # differ by its XOR; ptxas keeps them all live across the loop and spills 24-28 bytes
        # (with 128B or 32B atoms alike). Unswizzled 8-column slabs (8 floats = 32 B: one L2
        # sector per row for the reduce-add) make them one base + constant offsets and stay
        # conflict-free (a warp's 8 rows x 32 B of one slab are 256 contiguous bytes); the TMA
        # reduce-add then takes hd/8 boxes.
        self.dq_swizzle = config.tile_m == 64
        self.dq_atom_cols = self.dq_cols if self.dq_swizzle else 8

    @classmethod
    def can_implement(cls, config: BwdConfig) -> tuple[bool, str]:
        return config.check()

    # ------------------------------------------------------------------------------------
    # host
    # ------------------------------------------------------------------------------------
    def launch_layout(self):
        """Names of the launch's tensors, in `__call__` order (see `jaxflash.ffi`)."""
        ins = ["q", "k", "v", "do", "lse2", "delta"]
        ins += mask_inputs(self.cfg, backward=True)
        ins += ["mod_offsets"] * bool(self.cfg.score_mod or self.cfg.mask_mod)
        ins += ["mod_blocks"] * bool(self.cfg.mask_mod) + [f"aux{i}" for i in range(len(
            self.cfg.aux))]
        outs = ["dq_acc", "dk", "dv"]
        if self.cfg.has_alibi:
            outs.append("alibi_parts")
        if self.cfg.deterministic:
            outs.append("dq_sem")
        return (tuple(ins), tuple(outs), FLOAT_SCALARS,
                INT_SCALARS if self.cfg.has_window else ())

    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashBwdSm90({self.cfg.key})")
        mQ, mK, mV, mdO, mLSE, mDelta = a.take(6)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        mAlibi = a.maybe(self.cfg.has_alibi)
        seg = a.maybe(self.cfg.has_segments, 4)
        # mods: (block range table or None, aux arrays, (batch, head) offsets or None)
        mOff = a.maybe(self.has_mods)
        mods = (a.maybe(bool(self.cfg.mask_mod)), a.take(len(self.cfg.aux)) if len(
            self.cfg.aux) > 1 else ((a.take(),) if self.cfg.aux else ()), mOff)
        mdQ, mdK, mdV = a.take(3)
        mdAlibi = a.maybe(self.cfg.has_alibi)
        mSem = a.maybe(self.cfg.deterministic)
        mFScalars = a.take()
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch(mQ, mK, mV, mdO, mLSE, mDelta, mQSeqlen, mKVSeqlen, mAlibi, seg[0], seg[1],
                    seg[2], seg[3], mdQ, mdK, mdV, mdAlibi, mSem, mFScalars, mIScalars, stream,
                    mods)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mQSeqlen: Optional[cute.Tensor],
               mKVSeqlen: Optional[cute.Tensor], mAlibi: Optional[cute.Tensor],
               mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor],
               mKVBlk: Optional[cute.Tensor], mQBlk: Optional[cute.Tensor], mdQ: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mdAlibi: Optional[cute.Tensor],
               mSem: Optional[cute.Tensor], mFScalars: cute.Tensor,
               mIScalars: Optional[cute.Tensor], stream: cuda.CUstream, mods=(None, (), None)):
        for t in (mQ, mK, mV, mdO, mdK, mdV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        for t in (mLSE, mDelta, mdQ):
            if const_expr(t.element_type != Float32):
                raise TypeError("lse2, delta and dq_acc must be float32")

        # The dQ accumulator receives atomic adds: zero it first, on the same stream (and the
        # semaphores of the deterministic mode).
        zero_fill(mdQ, stream)
        if const_expr(self.cfg.deterministic):
            zero_fill(mSem, stream)
            mSem = layouts.select_modes(mSem, [2, 1, 0])  # (m blocks, N, B)
        if const_expr(self.cfg.has_alibi):
            zero_fill(mdAlibi, stream)  # key blocks no query sees write nothing

        # [B, T, N, H] -> (T, H, N, B): the two tiled modes first, as TMA boxes want (the
        # dq_flat accumulator [B, N, blocks, tile_m * H] is addressed as it is).
        mQ, mK, mV, mdO, mdK, mdV = [layouts.select_modes(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        if const_expr(not self.dq_flat):
            mdQ = layouts.select_modes(mdQ, [1, 3, 2, 0])
        mLSE, mDelta = [layouts.select_modes(t, [2, 1, 0]) for t in (mLSE, mDelta)]  # (Tp, N, B)

        tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq = self.tiled_mmas()
        (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sRow_layout,
         sdQ_layout) = self.smem_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        sel = lambda l: cute.select(l, mode=[0, 1])
        qdo_op, mc = self.qdo_load_op()  # TMA multicast to a key-block pair (`q_multicast`)
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(
            qdo_op, mQ, sel(sQ_layout), (self.tile_m, self.hd), mc)
        tma_dO, tma_mdO = cpasync.make_tiled_tma_atom(
            qdo_op, mdO, sel(sdO_layout), (self.tile_m, self.hdv), mc)
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (self.tile_n, self.hd))
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (self.tile_n, self.hdv))
        row1 = cute.select(sRow_layout, mode=[0])
        tma_LSE, tma_mLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, row1, (self.tile_m,), 1)
        tma_Dl, tma_mDelta = cpasync.make_tiled_tma_atom(g2s, mDelta, row1, (self.tile_m,), 1)
        tma_dK, tma_mdK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (self.tile_n, self.hd))
        tma_dV, tma_mdV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, (self.tile_n, self.hdv))
        tma_dQ, tma_mdQ = None, mdQ
        if const_expr(self.dq_box):  # (`dq_flat`: one flat bulk reduce per step, no tensor map)
            tma_dQ, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ, sdQ_layout, (self.tile_m, self.hd))
        self.q_bytes = cute.size_in_bytes(self.dtype, sel(sQ_layout)) + self.tile_m * 4
        self.do_bytes = cute.size_in_bytes(self.dtype, sel(sdO_layout)) + self.tile_m * 4
        self.kv_bytes = (cute.size_in_bytes(self.dtype, sK_layout)
                         + cute.size_in_bytes(self.dtype, sV_layout))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        S = mK.shape[0]
        num_n_blocks = self.pair_grid_x((S + self.tile_n - 1) // self.tile_n)
        self.kernel(
            tma_mQ, tma_mK, tma_mV, tma_mdO, tma_mLSE, tma_mDelta, tma_mdK, tma_mdV,
            tma_mdQ if self.dq_box else mdQ, mQSeqlen, mKVSeqlen,
            (mAlibi, mQSeg, mKVSeg, mKVBlk, mQBlk, mdAlibi, mods), tma_Q, tma_K, tma_V, tma_dO,
            tma_LSE, tma_Dl, tma_dK, tma_dV, tma_dQ, mSem, mFScalars, mIScalars, sQ_layout,
            sdO_layout, sK_layout, sV_layout, sdS_layout, sRow_layout, sdQ_layout,
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, SharedStorage,
        ).launch(grid=[num_n_blocks, mK.shape[2], mK.shape[3]], block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1, **self.pair_launch())

    # The two things the subclass `FlashBwdSm90Wide` changes; everything else of the launch
    # (TMA atoms, shared storage, grid) is shared. Called while tracing `launch`.
    def tiled_mmas(self):
        """(S^T / dP^T, dK, dV, dQ) tiled MMAs of the key-split scheme."""
        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wgs = self.num_mma_wg
        # S^T = K Q^T and dP^T = V dO^T: M = keys (one 64-row atom per warpgroup), N = queries.
        tiled_mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(wgs, 1, 1),
            tiler_mn=(64, self.tile_m))
        # dK += dS^T Q, dV += P^T dO: A from registers (the S^T / dP^T accumulators' layout).
        tiled_mma_dk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN, Float32, atom_layout_mnk=(wgs, 1, 1),
            tiler_mn=(64, self.hd), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_dv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN, Float32, atom_layout_mnk=(wgs, 1, 1),
            tiler_mn=(64, self.hdv), a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: M = the tile_m queries, split over the warpgroups as `dq_atoms` says, both
        # operands read MN-major (dS^T and K as stored).
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atom_layout_mnk=self.dq_atoms,
            tiler_mn=(64, self.dq_cols))
        return tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq

    def row_layout(self):
        """LSE / delta rows in shared memory, [tile_m, stage]: each stage is a TMA
        destination, 128-byte aligned (tile_m floats, a multiple of 32). Shared by both
        backward kernels."""
        return cute.make_layout((self.tile_m, self.num_stages), stride=(1, self.tile_m))

    def smem_layouts(self):
        """(Q, dO, K, V, dS^T, LSE / delta rows, dQ) shared-memory layouts."""
        sQ_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hd, self.num_stages)
        sdO_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hdv, self.num_stages)
        # K is read as B of the dQ GEMM in dq_cols-column slices: the swizzle atom must fit one.
        sK_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hd, atom_cols=self.dq_cols)
        sV_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hdv)
        sdS_layout = layouts.smem_layout(self.dtype, self.tile_n, self.tile_m, 2)
        sRow_layout = self.row_layout()
        sdQ_layout = self.dq_flat_layout() if self.dq_flat else layouts.smem_layout(
            Float32, self.tile_m, self.hd, atom_cols=self.dq_atom_cols, swizzle=self.dq_swizzle)
        return (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sRow_layout,
                sdQ_layout)

    # ------------------------------------------------------------------------------------
    # device
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
        mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQ: cute.Tensor,
        mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor], feats,
        tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom, tma_dO: cute.CopyAtom,
        tma_LSE: cute.CopyAtom, tma_Dl: cute.CopyAtom, tma_dK: cute.CopyAtom,
        tma_dV: cute.CopyAtom, tma_dQ: cute.CopyAtom, mSem: Optional[cute.Tensor],
        mFScalars: cute.Tensor,
        mIScalars: Optional[cute.Tensor], sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout, sdQ_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma, tiled_mma_dk: cute.TiledMma, tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dl, tma_dK, tma_dV):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.dq_box):
                cpasync.prefetch_descriptor(tma_dQ)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipes = TmaPipelines(self.num_mma_threads)
        pipe_kv = pipes.make(storage.mbar_kv.data_ptr(), 1, self.kv_bytes)
        qdo_cl = self.qdo_pipeline_layout()
        pipe_q = pipes.make(storage.mbar_q.data_ptr(), self.num_stages, self.q_bytes, qdo_cl)
        pipe_do = pipes.make(storage.mbar_do.data_ptr(), self.num_stages, self.do_bytes, qdo_cl)
        pipes.init_done(self.cluster_shape())

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sDelta = storage.sDelta.get_tensor(sRow_layout)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        # Runtime scalars (device-resident: new values never recompile).
        softmax_scale = mFScalars[0]
        pre_scale = Float32(1.0)
        scale_log2 = softmax_scale * LOG2_E
        if const_expr(self.cfg.has_softcap):
            softcap = mFScalars[1]
            pre_scale = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        if const_expr(self.has_score_mod):  # the program takes the scaled logit
            pre_scale, scale_log2 = self.mod_scales(softmax_scale)
        window_left = Int32(0)
        window_right = Int32(0)
        if const_expr(self.cfg.has_window):
            window_left = mIScalars[0]
            window_right = mIScalars[1]
            if const_expr(self.cfg.is_causal):
                window_right = cutlass.min(window_right, Int32(0))

        T = mQ.shape[0]
        n_block, kv_head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.tail_lpt):  # the last heads key-block-major (`bwd_order`)
            n_block, kv_head, batch = block_coords(T, (self.hd + self.hdv) * 2 + self.hd * 4,
                                                   self.pair_size)
        S = mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        seqlen_q = T
        if const_expr(mQSeqlen is not None):
            seqlen_q = cutlass.max(cutlass.min(T, mQSeqlen[batch]), 0)
        seqlen_k = S
        if const_expr(mKVSeqlen is not None):
            seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
        blocks = QueryBlockRange(self.tile_m, self.tile_n, self.has_right, self.has_left,
                                 window_left, window_right)
        m_min, m_max = blocks.m_block_min_max(self.range_block(n_block), seqlen_q, seqlen_k)
        mKVBlk = feats[3]
        if const_expr(self.cfg.has_segments):
            # Segment block skipping: only query blocks whose ids can meet this key block's
            # (exact for sorted, document-packed ids; see `jaxflash.kernels.common.segments`).
            m_min = cutlass.max(m_min, mKVBlk[batch, n_block, 2])
            m_max = cutlass.max(cutlass.min(m_max, mKVBlk[batch, n_block, 3]), m_min)
        m_min, m_max = self.mod_m_range(feats[6][0], batch, kv_head, n_block, m_min, m_max)
        num_m = m_max - m_min
        num_steps = group * num_m

        pipeline.pipeline_init_wait(self.cluster_shape())

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                             tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dl, pipe_kv, pipe_q,
                             pipe_do, n_block, kv_head, batch, group, m_min, num_m, num_steps)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(mdQ, mdK, mdV, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, tma_dK, tma_dV,
                         tma_dQ,
                         pipe_kv, pipe_q, pipe_do, tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv,
                         tiled_mma_dq, tidx - 128, warp_idx, softmax_scale, pre_scale,
                         scale_log2, window_left, window_right, n_block, kv_head, batch, group,
                         m_min, num_m, num_steps, seqlen_k, T, mSem, blocks, feats)
        self.pair_exit()

    @cute.jit
    def produce(self, mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, tma_Q,
                tma_K, tma_V, tma_dO, tma_LSE, tma_Dl, pipe_kv, pipe_q, pipe_do,
                n_block: Int32, kv_head: Int32, batch: Int32, group: Int32, m_min: Int32,
                num_m: Int32, num_steps: Int32):
        """Warp 0: K and V once, then (Q + LSE, dO + delta) per step, in the consumers' order.
        Nothing at all is loaded for a key block no query sees (the consumers then only write
        zero dK/dV, into K's and V's buffers)."""
        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.hd),
                                 (n_block, 0))
            gV = cute.local_tile(mV[None, None, kv_head, batch], (self.tile_n, self.hdv),
                                 (n_block, 0))
            tKsK, tKgK = layouts.tma_tiles(tma_K, sK, gK)
            tVsV, tVgV = layouts.tma_tiles(tma_V, sV, gV)
            pipe_kv.producer_acquire(kv_state)
            cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            mc_kw = self.qdo_copy_kw()
            for step in cutlass.range(num_steps, unroll=1):
                g = step // num_m
                m_block = m_min + step - g * num_m
                head = kv_head * group + g
                gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hd),
                                     (None, 0))
                gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdv),
                                      (None, 0))
                gLSE = cute.local_tile(mLSE[None, head, batch], (self.tile_m,), (None,))
                gDelta = cute.local_tile(mDelta[None, head, batch], (self.tile_m,), (None,))
                tQsQ, tQgQ = self.qdo_tiles(tma_Q, sQ, gQ)
                tdOsdO, tdOgdO = self.qdo_tiles(tma_dO, sdO, gdO)
                tLsL, tLgL = layouts.tma_tiles(tma_LSE, sLSE, gLSE, rank=1)
                tDsD, tDgD = layouts.tma_tiles(tma_Dl, sDelta, gDelta, rank=1)
                # (pipeline, tile atom / gmem / smem, row atom / gmem / smem), in load order
                for pipe, atom, gT, sT, ratom, gR, sR in self.qdo_load_order(
                        (pipe_q, tma_Q, tQgQ, tQsQ, tma_LSE, tLgL, tLsL),
                        (pipe_do, tma_dO, tdOgdO, tdOsdO, tma_Dl, tDgD, tDsD)):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(atom, gT[None, m_block], sT[None, state.index], tma_bar_ptr=bar,
                              **mc_kw)
                    cute.copy(ratom, gR[None, m_block], sR[None, state.index], tma_bar_ptr=bar)
                state.advance()

    @cute.jit
    def consume(self, mdQ, mdK, mdV, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, tma_dK, tma_dV,
                tma_dQ, pipe_kv, pipe_q, pipe_do, tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv,
                tiled_mma_dq, tidx: Int32, warp_idx: Int32, softmax_scale: Float32,
                pre_scale: Float32, scale_log2: Float32, window_left: Int32,
                window_right: Int32, n_block: Int32, kv_head: Int32, batch: Int32,
                group: Int32, m_min: Int32, num_m: Int32, num_steps: Int32, seqlen_k: Int32,
                T: Int32, mSem: Optional[cute.Tensor], blocks: QueryBlockRange, feats):
        mAlibi, mQSeg, mKVSeg, mKVBlk, mQBlk, mdAlibi, mods = feats
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dk = tiled_mma_dk.get_slice(wg * 128)
        wg_dv = tiled_mma_dv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_dk = tiled_mma_dk.get_slice(tidx)
        thr_dv = tiled_mma_dv.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        # Operand fragments (smem descriptors) and accumulators.
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(layouts.transpose_mn(sdO)))
        tdKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(layouts.transpose_mn(sQ)))
        dq_ops = self.dq_operands(wg_dq, sdS, sK)
        (acc_S, acc_dP, acc_dK, acc_dV, acc_dQ, coords, st_atom, thr_st_ds, tdSsdS,
         tdQsdQ) = self.consumer_tiles(tiled_mma_sdp, tiled_mma_dq, thr_sdp, thr_dk, thr_dv,
                                       thr_dq, tidx, sdS, sdQ)
        # ALiBi slope in S^T units (the exp2 applies the softmax scale to the whole score).
        alibi_inv = Float32(1.0) / softmax_scale
        key_segs = None
        if const_expr(self.cfg.has_segments):
            key_segs = SegmentRows.load(
                coords, cute.size(layouts.acc_as_rows_cols(acc_S), mode=[0]),
                n_block * self.tile_n, mKVSeg[batch, None], mKVSeg.shape[1],
                mKVBlk[batch, n_block, 0], mKVBlk[batch, n_block, 1])
        dslope = Float32(0.0)
        full = self.mod_full_range(mods[0], batch, kv_head, n_block)
        if const_expr(mods[2] is not None):  # the mods' (batch, head) offsets, read once
            mods = (mods[0], mods[1], (mods[2][0], mods[2][1]))

        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)  # K and V stay until the end: never released
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_stages)
            for step in cutlass.range(num_steps, unroll=1):
                g = step // num_m
                m_block = m_min + step - g * num_m
                head = kv_head * group + g
                stage = state.index
                buf = step % 2
                pipe_q.consumer_wait(state)
                layouts.wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage],
                              zero_init=True, wait=-1)
                pipe_do.consumer_wait(state)
                layouts.wgmma(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, stage],
                              zero_init=True, wait=-1)
                warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
                if const_expr(self.cfg.has_softcap):
                    for i in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[i] = cute.math.tanh(acc_S[i] * pre_scale, fastmath=True)
                self.mod_scores(acc_S, acc_dP, coords, sDelta, stage, n_block, m_block, batch,
                                head, mods, pre_scale, full)
                # Only blocks on a boundary (key tail, diagonal, window edge) pay for the mask.
                if const_expr(self.cfg.has_alibi):
                    apply_alibi(acc_S, coords, n_block * self.tile_n, m_block * self.tile_m,
                                mAlibi[0, head] * alibi_inv)
                if const_expr(self.cfg.has_segments):
                    # Most block pairs of packed documents lie inside one document: no compare.
                    if key_segs.block_needs_compare(mQBlk[batch, m_block, 0],
                                                    mQBlk[batch, m_block, 1]):
                        apply_segment_mask(acc_S, coords, key_segs, m_block * self.tile_m,
                                           mQSeg[batch, None], T)
                if blocks.needs_mask(n_block, m_block, seqlen_k):
                    apply_mask_kq(acc_S, coords, n_block, m_block, self.tile_n, self.tile_m,
                                  seqlen_k, window_left, window_right, self.has_right,
                                  self.has_left)
                if const_expr(self.cfg.early_dv):
                    # P^T while the tensor cores still compute dP^T, then dV += P^T dO issued
                    # before dS^T is formed (dS^T's arithmetic runs behind the dV GEMM).
                    rT = None
                    if const_expr(self.cfg.has_softcap):
                        rT = cute.make_rmem_tensor_like(acc_S, Float32)  # tanh, for dS^T
                        rT.store(acc_S.load())
                    self.probs(acc_S, coords, sLSE, stage, scale_log2)
                    rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    layouts.wgmma(tiled_mma_dv, acc_dV, layouts.acc_as_operand_a(rP),
                                  tdVrdOt[None, None, None, stage], zero_init=False, wait=1)
                    self.grads(acc_S, acc_dP, rT, coords, sDelta, stage)  # dP^T done (<= 1)
                    rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                    rdS.store(acc_dP.load().to(self.dtype))
                else:
                    warpgroup.wait_group(0)
                    rP, rdS = self.probs_and_grads_lowp(acc_S, acc_dP, coords, sLSE, sDelta,
                                                        stage, scale_log2)
                    # dV += P^T dO and dK += dS^T Q from registers, while dS^T goes to smem.
                    layouts.wgmma(tiled_mma_dv, acc_dV, layouts.acc_as_operand_a(rP),
                                  tdVrdOt[None, None, None, stage], zero_init=False, wait=-1)
                layouts.wgmma(tiled_mma_dk, acc_dK, layouts.acc_as_operand_a(rdS),
                              tdKrQt[None, None, None, stage], zero_init=False, wait=-1)
                if const_expr(self.cfg.has_alibi):
                    # acc_dP still holds dS^T in float32 (under the dK GEMM, which reads rdS).
                    # Measured with ptxas: here hd <= 96 has no spills; at the end of the step
                    # hd 96 spilled 20 bytes; hd 128 spills or serializes either way (refused).
                    dslope = self.alibi_grad_step(acc_dP, coords, n_block, m_block,
                                                  m_min + num_m - 1, head, batch, warp_idx,
                                                  mdAlibi, dslope)
                cute.copy(st_atom, thr_st_ds.retile(rdS), tdSsdS[None, None, None, buf])
                cute.arch.fence_view_async_shared()  # smem writes -> visible to wgmma
                if warp_idx == 4:
                    # The previous step's reduce has read sdQ once this barrier is passed.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=self.num_mma_threads)
                self.dq_gemm(tiled_mma_dq, acc_dQ, dq_ops, buf)
                pipe_q.consumer_release(state)
                pipe_do.consumer_release(state)
                state.advance()
                self.flush_dq(mdQ, sdQ, tdQsdQ, tma_dQ, acc_dQ, m_block, head, batch, n_block,
                              warp_idx, mSem, blocks)

        self.store_dkdv(acc_dK, acc_dV, softmax_scale, st_atom, tiled_mma_dk, tiled_mma_dv, tidx,
                        sK, sV, mdK, mdV, tma_dK, tma_dV, kv_head, batch, n_block, warp_idx)

    @cute.jit
    def store_dkdv(self, acc_dK, acc_dV, softmax_scale: Float32, st_atom, tiled_mma_dk,
                   tiled_mma_dv, tidx, sK, sV, mdK, mdV, tma_dK, tma_dV, kv_head, batch, n_block,
                   warp_idx):
        """Epilogue of both backward kernels: dK (scaled) and dV through K's and V's shared
        buffers (stmatrix), then one TMA store each from warp 4."""
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[i] = acc_dK[i] * softmax_scale
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdK.store(acc_dK.load().to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        # Both warpgroups' last GEMMs that read sK / sV (dQ here, dK / dQ in the wide kernel)
        # must be done before those buffers are overwritten.
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        thr_st_dk = cute.make_tiled_copy_C(st_atom, tiled_mma_dk).get_slice(tidx)
        thr_st_dv = cute.make_tiled_copy_C(st_atom, tiled_mma_dv).get_slice(tidx)
        cute.copy(st_atom, thr_st_dk.retile(rdK), thr_st_dk.partition_D(sK))
        cute.copy(st_atom, thr_st_dv.retile(rdV), thr_st_dv.partition_D(sV))
        cute.arch.fence_view_async_shared()  # make the smem writes visible to the TMA unit
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        gdK = cute.local_tile(mdK[None, None, kv_head, batch], (self.tile_n, self.hd),
                              (n_block, 0))
        gdV = cute.local_tile(mdV[None, None, kv_head, batch], (self.tile_n, self.hdv),
                              (n_block, 0))
        tdKsdK, tdKgdK = layouts.tma_tiles(tma_dK, sK, gdK)
        tdVsdV, tdVgdV = layouts.tma_tiles(tma_dV, sV, gdV)
        if warp_idx == 4:
            cute.copy(tma_dK, tdKsdK, tdKgdK)
            cute.copy(tma_dV, tdVsdV, tdVgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem must outlive the reads

    def dq_operands(self, wg_dq, sdS, sK):
        """The dQ GEMM's shared-memory operand fragments: A = dS (dS^T's transposed view, a
        buffer mode last), B = K^T. Plain Python (inlined while `consume` is traced)."""
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(layouts.transpose_mn(sdS)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(layouts.transpose_mn(sK)))
        return tdQrdS, tdQrKt

    def dq_gemm(self, tiled_mma_dq, acc_dQ, dq_ops, buf):
        """acc_dQ = dS K from dS^T buffer `buf` (`dq_operands`), one wgmma group, waited for."""
        tdQrdS, tdQrKt = dq_ops
        layouts.wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt,
                      zero_init=True, wait=0)

    def consumer_tiles(self, tiled_mma_sdp, tiled_mma_dq, thr_sdp, thr_dk, thr_dv, thr_dq,
                       tidx, sdS, sdQ):
        """A consumer thread's accumulators (dK / dV zeroed), its coordinates in the S^T
        tile, its stmatrix atom, slice and partition of the dS^T (and P^T) buffer, and its
        partition of the dQ tile: the same in both backward kernels (only the MMAs that shape
        them differ). Plain Python, inlined while `consume` is traced."""
        acc_S = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)))
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C((self.tile_n, self.hd)))
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C((self.tile_n, self.hdv)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        coords = TileCoords.make(tiled_mma_sdp, tidx, (self.tile_n, self.tile_m))
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st_ds = cute.make_tiled_copy_C(st_atom, tiled_mma_sdp).get_slice(tidx)
        tdSsdS = thr_st_ds.partition_D(sdS)
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.tile_m, self.hd)))
        if const_expr(self.dq_flat):
            tdQsdQ = self.dq_flat_partition(sdQ, tidx)
        else:
            tdQsdQ = thr_dq.partition_C(sdQ)
        return (acc_S, acc_dP, acc_dK, acc_dV, acc_dQ, coords, st_atom, thr_st_ds, tdSsdS,
                tdQsdQ)
