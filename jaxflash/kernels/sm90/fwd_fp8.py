"""FP8 (e4m3) FlashAttention forward for Hopper (sm_90a): `FlashFwdSm90Fp8`.

The bf16 forward (`sm90.fwd.FlashFwdSm90`) with FP8 operands; what changes and why:

- Both GEMMs are FP8 wgmma (k = 32 a step), which reads only K-major operands. Q and K are
  K-major as loaded; V is not (its keys are rows). The producer warpgroup transposes it: warp 0
  TMA-loads K, Q and V (V into a staging buffer, its own 2-stage pipeline), and all four warps
  move each staged V block into a (head dim x keys) buffer (`v_transpose`), which feeds the
  consumers through a second pipeline. Keys are permuted on the way so that P needs no data
  exchange between threads (`layouts.acc_as_fp8_operand_a`).
- P = exp2(...) is scaled by 2^8 (`OnlineSoftmax(p_shift_log2=8)`: P in [0, 256], inside
  e4m3's 448, small probabilities stay normal) and converted to e4m3 in registers; the row sum
  carries the same factor (cancels in O), the LSE takes it out.
- Scales per (batch, head), or per 128-row block (the contract's layout, `Fp8FwdConfig`'s
  q/k/v_blocks): q's (one per tile) and k's (when not per block) fold into the softmax's exp2
  scale (or the softcap's pre-scale); a k block's scale folds into that block's softmax step
  (its row max and exponent multiplier; under softcap or the conditional rescale it multiplies
  the block's scores instead); v's scale goes into the final 1 / rowsum, and with v blocks the
  ratio of consecutive blocks' scales into the O rescale of every block (O accumulates in the
  current block's units). Block scales are read before the block's GEMMs are issued, so their
  loads' latency hides under them. O leaves in ``out_dtype``.
- O (16-bit) is staged for its TMA store in the loaded-V buffers (free once the last block is
  transposed), extended over the V^T buffers after a consumer barrier when it is larger.
- One tile per CTA, or (``persistent``, up to hd 128: O then has its own buffer) one CTA per SM
  looping over tiles, the producer warpgroup walking the same sequence; masks, lengths, GQA, softcap and segment ids are the
  bf16 kernel's own code (`mask.py`, `segments.py`, the consumer mainloop).
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
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.mask import BlockRange, SegmentRows, TileCoords
from jaxflash.kernels.common.pipes import TmaPipelines
from jaxflash.kernels.common.scheduler import NUM_SMS, TileScheduler
from jaxflash.kernels.common.softmax import OnlineSoftmax
from jaxflash.kernels.sm90 import v_transpose
from jaxflash.kernels.sm90.fwd import _BAR_WG_SCHED, FlashFwdSm90, _ConsumerCtx, _ScoreMods
from jaxflash.kernels.sm90.fwd_epilogue import BAR_EPILOGUE
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS, L2_SECTION_MB
from jaxflash.kernels.variants.fwd_fp8 import DESCALES, Fp8FwdConfig

LOG2_E = math.log2(math.e)
# P scaled by 2^8 before e4m3 (see the module docstring); `jaxflash.fp8.contract.P_SCALE_LOG2`
# (a sibling layer, not importable here; tests/kernels/test_fp8_compile.py holds them equal)
P_SHIFT_LOG2 = 8

_FP8 = {"float8_e4m3fn": cutlass.Float8E4M3FN}
_OUT = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class FlashFwdSm90Fp8(FlashFwdSm90):
    """Hopper FP8 forward for one `Fp8FwdConfig` variant.

    Host entry: mQ [B, T, N, H], mK [B, S, K, H], mV [B, S, K, Hv] e4m3 (row-major), optional
    mQSeqlen / mKVSeqlen [B] int32 and segment inputs (as `FlashFwdSm90`), mQD [B, N, nq], mKD
    [B, K, nk], mVD [B, K, nv] float32 scales, mO [B, T, N, Hv] (out_dtype), mLSE [B, N, T] float32,
    float scalars (softmax_scale, softcap), int scalars (window) when windowed, stream.
    """

    def __init__(self, config: Fp8FwdConfig):
        ok, why = config.check()
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = _FP8[config.dtype]
        self.o_dtype = _OUT[config.out_dtype]
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        self.num_mma_wg = config.num_mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 * (self.num_mma_wg + 1)
        # The bf16 kernel's split: the transposing producer fits in 24 registers as long as
        # its block loop is not unrolled (`v_transpose`); at hd 256 the consumers need every
        # register (the 64 x 256 fp32 O alone is 128; at 232 ptxas serialized the wgmma).
        # Three consumer warpgroups (192 rows, hd 64): 32 / 160.
        self.producer_regs, self.mma_regs = {2: (24, 240), 3: (32, 160)}[self.num_mma_wg]
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window
        # as the bf16 kernel at 192 rows: a fresh S fragment per block, masks by select
        self.fresh_s = self.num_mma_wg >= 3
        self.mask_by_select = self.num_mma_wg == 3 or config.mask_select
        self.pingpong = self.num_mma_wg == 2 and self.hd <= 128
        self.persistent = config.persistent
        self.tile_pipe = False
        self.separate_o = config.separate_o
        self.wg_epilogue = False
        self.lazy_rescale = config.lazy_rescale
        # Key-block scales fold into the softmax (`OnlineSoftmax.step`'s col_scale) instead of
        # multiplying every score, except where the scores need their true values first (the
        # softcap's tanh) or the conditional rescale's step runs.
        self.fold_k = config.k_blocks and not config.has_softcap and not config.lazy_rescale

    def launch_layout(self):
        ins = ["q", "k", "v"]
        ins += mask_inputs(self.cfg)
        ins += list(DESCALES)
        return tuple(ins), ("o", "lse"), FLOAT_SCALARS, INT_SCALARS if self.cfg.has_window else ()

    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashFwdSm90Fp8({self.cfg.key})")
        mQ, mK, mV = a.take(3)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        seg = a.maybe(self.cfg.has_segments, 4)
        mQD, mKD, mVD = a.take(3)
        mO, mLSE, mFScalars = a.take(3)
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch_fp8(mQ, mK, mV, mQSeqlen, mKVSeqlen, seg[0], seg[1], seg[2], seg[3], mQD,
                        mKD, mVD, mO, mLSE, mFScalars, mIScalars, stream)

    @cute.jit
    def launch_fp8(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                   mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
                   mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor],
                   mQBlk: Optional[cute.Tensor], mKVBlk: Optional[cute.Tensor],
                   mQD: cute.Tensor, mKD: cute.Tensor, mVD: cute.Tensor, mO: cute.Tensor,
                   mLSE: cute.Tensor, mFScalars: cute.Tensor,
                   mIScalars: Optional[cute.Tensor], stream: cuda.CUstream):
        for t in (mQ, mK, mV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        if const_expr(mO.element_type != self.o_dtype):
            raise TypeError(f"o must be {self.o_dtype}, got {mO.element_type}")
        for t in (mLSE, mQD, mKD, mVD):
            if const_expr(t.element_type != Float32):
                raise TypeError("lse and the descales must be float32")

        mQ, mK, mO = [layouts.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        if const_expr(self.cfg.v_transposed):
            mV = layouts.select_modes(mV, [2, 3, 1, 0])  # V^T [B, K, Hv, Sp] -> (Hv, Sp, K, B)
        else:
            mV = layouts.select_modes(mV, [1, 3, 2, 0])
        mLSE = layouts.select_modes(mLSE, [2, 1, 0])  # (T, N, B)

        K_ = cute.nvgpu.OperandMajorMode.K
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n))
        # B = V^T (head dim x keys), K-major: the transposed buffer
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.hdv), a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hd)
        sK_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hd, self.num_stages)
        sV_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hdv, self.num_stages)
        sVt_layout = layouts.smem_layout(self.dtype, self.hdv, self.tile_n, self.num_stages)
        sO_layout = layouts.smem_layout(self.o_dtype, self.tile_m, self.hdv)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, self.hd))
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hd), 1)
        if const_expr(self.cfg.v_transposed):  # straight into the V^T stages
            tma_V, tma_mV = cpasync.make_tiled_tma_atom(
                g2s, mV, cute.select(sVt_layout, mode=[0, 1]), (self.hdv, self.tile_n), 1)
        else:
            tma_V, tma_mV = cpasync.make_tiled_tma_atom(
                g2s, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.hdv), 1)
        tma_O, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.hdv))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        # O's staging: the loaded-V buffers, or those and the V^T ones right after them
        # (`store_o_whole`); both sizes are multiples of 1024, so the two are contiguous.
        o_bytes = cute.cosize(sO_layout) * (self.o_dtype.width // 8)
        assert o_bytes <= cute.cosize(sV_layout) + cute.cosize(sVt_layout)
        vraw_bytes = cute.cosize(sV_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_vr: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_vt: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sVr: cute.struct.Align[cute.struct.MemRange[self.dtype, vraw_bytes], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sVt_layout)],
                                   1024]
            sO: cute.struct.Align[cute.struct.MemRange[
                self.dtype, o_bytes if self.separate_o else 0], 1024]

        T = mQ.shape[0]
        num_m_blocks = (T + self.tile_m - 1) // self.tile_m
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        scheduler = TileScheduler(lpt=self.cfg.lpt, section_bytes=L2_SECTION_MB * 1024 * 1024)
        grid = num_tiles
        if const_expr(self.persistent):
            grid = cutlass.min(num_tiles, NUM_SMS)

        self.kernel_fp8(
            tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, mQSeqlen, mKVSeqlen, mQSeg, mKVSeg, mQBlk,
            mKVBlk, mQD, mKD, mVD, tma_Q, tma_K, tma_V, tma_O, mFScalars, mIScalars,
            sQ_layout, sK_layout, sV_layout, sVt_layout, sO_layout, tiled_mma_qk, tiled_mma_pv,
            scheduler, num_m_blocks, SharedStorage,
        ).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    @cute.kernel
    def kernel_fp8(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
        mLSE: cute.Tensor, mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
        mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor],
        mQBlk: Optional[cute.Tensor], mKVBlk: Optional[cute.Tensor], mQD: cute.Tensor,
        mKD: cute.Tensor, mVD: cute.Tensor, tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom, tma_O: cute.CopyAtom, mFScalars: cute.Tensor,
        mIScalars: Optional[cute.Tensor], sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        scheduler: cutlass.Constexpr, num_m_blocks: Int32, SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipes = TmaPipelines(self.num_mma_threads)
        pipe_q = pipes.make(storage.mbar_q.data_ptr(), 1, self.q_bytes)
        pipe_k = pipes.make(storage.mbar_k.data_ptr(), self.num_stages, self.k_bytes)
        pipe_vr = None
        if const_expr(self.cfg.v_transposed):
            # V^T from global memory: TMA -> the consumers, as K
            pipe_vt = pipes.make(storage.mbar_vt.data_ptr(), self.num_stages, self.v_bytes)
        else:
            # loaded V: TMA -> the producer warpgroup's 4 warps
            pipe_vr = TmaPipelines(128).make(storage.mbar_vr.data_ptr(), self.num_stages,
                                             self.v_bytes)
            # transposed V: the producer warpgroup's 128 threads -> the consumer threads
            pipe_vt = pipeline.PipelineAsync.create(
                num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads),
                barrier_storage=storage.mbar_vt.data_ptr(), defer_sync=True)
        pipes.init_done()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVr = storage.sVr.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        if const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner,
                                       dtype=self.o_dtype)
        else:
            sO = storage.sVr.get_tensor(sO_layout.outer, swizzle=sO_layout.inner,
                                        dtype=self.o_dtype)

        softmax_scale = mFScalars[0]
        pre_scale = Float32(1.0)
        scale_log2 = softmax_scale * LOG2_E
        if const_expr(self.cfg.has_softcap):
            softcap = mFScalars[1]
            pre_scale = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
        window_left = Int32(0)
        window_right = Int32(0)
        if const_expr(self.cfg.has_window):
            window_left = mIScalars[0]
            window_right = mIScalars[1]
            if const_expr(self.cfg.is_causal):
                window_right = cutlass.min(window_right, Int32(0))

        T = mQ.shape[0]
        blocks = BlockRange(self.tile_m, self.tile_n, self.has_right, self.has_left,
                            window_left, window_right)
        bid, _, _ = cute.arch.block_idx()

        pipeline.pipeline_init_wait()

        grid, _, _ = cute.arch.grid_dim()
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            raw_words = storage.sVr.get_tensor(cute.make_layout(cute.cosize(sV_layout) // 4),
                                               dtype=Int32)
            vt_words = storage.sVt.get_tensor(cute.make_layout(cute.cosize(sVt_layout) // 4),
                                              dtype=Int32)
            P = pipeline.PipelineUserType
            states = (pipeline.make_pipeline_state(P.Producer, 1),  # Q (warp 0)
                      pipeline.make_pipeline_state(P.Producer, self.num_stages),  # K (warp 0)
                      pipeline.make_pipeline_state(P.Producer, self.num_stages),  # V staged
                      pipeline.make_pipeline_state(P.Consumer, self.num_stages),  # V read
                      pipeline.make_pipeline_state(P.Producer, self.num_stages))  # V^T
            sV_in = sVt if self.cfg.v_transposed else sVr  # where TMA puts V
            pargs = (mQ, mK, mV, mQSeqlen, mKVSeqlen, mQBlk, sQ, sK, sV_in, tma_Q, tma_K, tma_V,
                     pipe_q, pipe_k, pipe_vr, pipe_vt, raw_words, vt_words, sV_layout,
                     sVt_layout, blocks, warp_idx, tidx)
            if const_expr(self.persistent):
                r = Int32(0)
                tile = scheduler.tile_of_round(r, bid, grid)
                while tile < num_tiles:
                    states = self.produce_fp8_tile(tile, scheduler, num_m_blocks, pargs, states)
                    r += 1
                    tile = scheduler.tile_of_round(r, bid, grid)
            else:
                self.produce_fp8_tile(bid, scheduler, num_m_blocks, pargs, states)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.num_stages)
            if const_expr(self.pingpong):
                if (tidx - 128) // 128 == 0:  # warpgroup 0 issues first
                    cute.arch.barrier_arrive(barrier_id=_BAR_WG_SCHED,
                                             number_of_threads=2 * 128)
            cargs = (mO, mLSE, sQ, sK, sVt, sO, tma_O, pipe_q, pipe_k, pipe_vt)
            segs = (mQD, mKD, mVD, mQSeg, mKVSeg, mQBlk, mKVBlk)
            if const_expr(self.persistent):
                r = Int32(0)
                tile = scheduler.tile_of_round(r, bid, grid)
                while tile < num_tiles:
                    q_state, kv_state = self.consume_tile(
                        tile, scheduler, num_m_blocks, mQ, mK, mQSeqlen, mKVSeqlen, blocks,
                        cargs, segs, q_state, kv_state, tiled_mma_qk, tiled_mma_pv, tidx - 128,
                        warp_idx, pre_scale, scale_log2, window_left, window_right, T)
                    r += 1
                    tile = scheduler.tile_of_round(r, bid, grid)
                # the last store reads sO before the CTA's shared memory goes away
                if warp_idx == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                self.consume_tile(bid, scheduler, num_m_blocks, mQ, mK, mQSeqlen, mKVSeqlen,
                                  blocks, cargs, segs, q_state, kv_state, tiled_mma_qk,
                                  tiled_mma_pv, tidx - 128, warp_idx, pre_scale, scale_log2,
                                  window_left, window_right, T)

    @cute.jit
    def produce_fp8_tile(self, tile: Int32, scheduler: cutlass.Constexpr, num_m_blocks: Int32,
                         pargs, states):
        """One tile's loads and V transposes by the producer warpgroup; returns the advanced
        pipeline states (Q, K, V staged, V read, V^T)."""
        (mQ, mK, mV, mQSeqlen, mKVSeqlen, mQBlk, sQ, sK, sVr, tma_Q, tma_K, tma_V, pipe_q, pipe_k,
         pipe_vr, pipe_vt, raw_words, vt_words, sV_layout, sVt_layout, blocks, warp_idx,
         tidx) = pargs
        m_block, head, batch = self.tile_coords(tile, scheduler, num_m_blocks, mQ, mK)
        n_min, n_max, _sq, _sk = self.tile_bounds(m_block, head, batch, mQ, mK, mQSeqlen,
                                                  mKVSeqlen, (mQBlk, None), blocks)
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        if const_expr(self.cfg.v_transposed):
            # (with v_transposed the V slot of pargs holds the V^T stages)
            return self.produce_fp8_vt(mQ, mK, mV, sQ, sK, sVr, tma_Q, tma_K, tma_V, pipe_q,
                                       pipe_k, pipe_vt, m_block, head, kv_head, batch, n_min,
                                       n_max, blocks, warp_idx, states)
        return self.produce_fp8(mQ, mK, mV, sQ, sK, sVr, tma_Q, tma_K, tma_V, pipe_q, pipe_k,
                                pipe_vr, pipe_vt, raw_words, vt_words, sV_layout, sVt_layout,
                                m_block, head, kv_head, batch, n_min, n_max, blocks, warp_idx,
                                tidx, states)

    @cute.jit
    def produce_fp8_vt(self, mQ, mK, mVt, sQ, sK, sVt, tma_Q, tma_K, tma_V, pipe_q, pipe_k,
                       pipe_vt, m_block: Int32, head: Int32, kv_head: Int32, batch: Int32,
                       n_min: Int32, n_max: Int32, blocks: BlockRange, warp_idx: Int32, states):
        """The producer's tile when V arrives transposed (``v_transposed``): warp 0 TMA-loads K,
        Q and V^T (straight into the consumers' V^T stages) in the consumers' order (right to
        left), one block ahead; no transpose. Returns the advanced states."""
        gQ = blocks.row_box(mQ[None, None, head, batch], m_block, self.hd)
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.hd), (None, 0))
        gVt = cute.local_tile(mVt[None, None, kv_head, batch], (self.hdv, self.tile_n),
                              (0, None))
        q_state, k_state, vr_state, vr_read, vt_state = states
        count = n_max - n_min
        if warp_idx == 0:
            tQsQ, tQgQ = layouts.tma_tiles(tma_Q, sQ, gQ)
            tKsK, tKgK = layouts.tma_tiles(tma_K, sK, gK)
            tVsV, tVgV = layouts.tma_tiles(tma_V, sVt, gVt)
            if count > 0:
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, n_max - 1], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                k_state.advance()
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if count > 0:
                pipe_vt.producer_acquire(vt_state)
                cute.copy(tma_V, tVgV[None, n_max - 1], tVsV[None, vt_state.index],
                          tma_bar_ptr=pipe_vt.producer_get_barrier(vt_state))
                vt_state.advance()
            for i in cutlass.range(count - 1, unroll=1):
                n = n_max - 2 - i
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, n], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                k_state.advance()
                pipe_vt.producer_acquire(vt_state)
                cute.copy(tma_V, tVgV[None, n], tVsV[None, vt_state.index],
                          tma_bar_ptr=pipe_vt.producer_get_barrier(vt_state))
                vt_state.advance()
        return q_state, k_state, vr_state, vr_read, vt_state

    @cute.jit
    def produce_fp8(self, mQ, mK, mV, sQ, sK, sVr, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_vr,
                    pipe_vt, raw_words, vt_words, sV_layout, sVt_layout, m_block: Int32,
                    head: Int32, kv_head: Int32, batch: Int32, n_min: Int32, n_max: Int32,
                    blocks: BlockRange, warp_idx: Int32, tidx: Int32, states):
        """The producer warpgroup's tile: warp 0 issues the TMA loads (K[last], Q, V[last],
        then K and V of the next block one ahead), and all four warps transpose each loaded V
        block into the consumers' V^T stage, in the consumers' order (right to left).
        Returns the advanced states."""
        gQ = blocks.row_box(mQ[None, None, head, batch], m_block, self.hd)
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.hd), (None, 0))
        gV = cute.local_tile(mV[None, None, kv_head, batch], (self.tile_n, self.hdv), (None, 0))
        tQsQ, tQgQ = layouts.tma_tiles(tma_Q, sQ, gQ)
        tKsK, tKgK = layouts.tma_tiles(tma_K, sK, gK)
        tVsV, tVgV = layouts.tma_tiles(tma_V, sVr, gV)
        q_state, k_state, vr_state, vr_read, vt_state = states
        count = n_max - n_min
        if warp_idx == 0:
            if count > 0:
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, n_max - 1], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                k_state.advance()
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if count > 0:
                pipe_vr.producer_acquire(vr_state)
                cute.copy(tma_V, tVgV[None, n_max - 1], tVsV[None, vr_state.index],
                          tma_bar_ptr=pipe_vr.producer_get_barrier(vr_state))
                vr_state.advance()
        for i in cutlass.range(count, unroll=1):
            n = n_max - 1 - i
            if warp_idx == 0:
                if n > n_min:  # the next block's K and V, one ahead of the transpose
                    pipe_k.producer_acquire(k_state)
                    cute.copy(tma_K, tKgK[None, n - 1], tKsK[None, k_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                    k_state.advance()
                    pipe_vr.producer_acquire(vr_state)
                    cute.copy(tma_V, tVgV[None, n - 1], tVsV[None, vr_state.index],
                              tma_bar_ptr=pipe_vr.producer_get_barrier(vr_state))
                    vr_state.advance()
            pipe_vr.consumer_wait(vr_read)
            pipe_vt.producer_acquire(vt_state)
            v_transpose.transpose_stage(raw_words, vt_words, sV_layout, sVt_layout,
                                        vr_read.index, vt_state.index, tidx, self.tile_n,
                                        self.hdv, 4)
            # the generic-proxy writes must be visible to the wgmma (async proxy) reading them
            cute.arch.fence_view_async_shared()
            pipe_vt.producer_commit(vt_state)
            # one lane a warp releases the staging stage: all of the warp's reads come first
            cute.arch.sync_warp()
            pipe_vr.consumer_release(vr_read)
            vr_read.advance()
            vt_state.advance()
        return q_state, k_state, vr_state, vr_read, vt_state

    @cute.jit
    def consume_at(self, m_block: Int32, head: Int32, batch: Int32, mQ, mK, mQSeqlen,
                   mKVSeqlen, blocks: BlockRange, cargs, segs, q_state, kv_state, tiled_mma_qk,
                   tiled_mma_pv, tidx: Int32, warp_idx: Int32, pre_scale: Float32,
                   scale_log2: Float32, window_left: Int32, window_right: Int32, T: Int32):
        mO, mLSE, sQ, sK, sVt, sO, tma_O, pipe_q, pipe_k, pipe_v = cargs
        mQD, mKD, mVD, mQSeg, mKVSeg, mQBlk, mKVBlk = segs
        n_min, n_max, seqlen_q, seqlen_k = self.tile_bounds(m_block, head, batch, mQ, mK,
                                                            mQSeqlen, mKVSeqlen, (mQBlk, None),
                                                            blocks)
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        # q's scale is one per tile either way; k's folds in here unless it varies by key
        # block (then `scores` multiplies each block's S by its own).
        q_idx = Int32(0)
        if const_expr(self.cfg.q_blocks):
            q_idx = m_block
        qk_descale = mQD[batch, head, q_idx]
        if const_expr(not self.cfg.k_blocks):
            qk_descale = qk_descale * mKD[batch, kv_head, 0]
        if const_expr(self.cfg.has_softcap):
            pre_scale = pre_scale * qk_descale  # tanh(x * descale * scale / softcap)
        else:
            scale_log2 = scale_log2 * qk_descale
        ctx = self.consumer_setup(sQ, sK, sVt, tiled_mma_qk, tiled_mma_pv, tidx, scale_log2)
        # O ends in the units of the last (leftmost) key block's v scale (`softmax_step`)
        v_last = Int32(0)
        if const_expr(self.cfg.v_blocks):
            v_last = cutlass.min(n_min, mVD.shape[2] - 1)
        ctx.v_descale = mVD[batch, kv_head, v_last]
        ctx._dynamic = _ConsumerCtx._dynamic + ("v_descale",)
        mods = _ScoreMods()
        dyn = []
        if const_expr(self.cfg.k_blocks):
            mods.kd = mKD[batch, kv_head, None]
            dyn.append("kd")
        if const_expr(self.cfg.v_blocks):
            mods.vd = mVD[batch, kv_head, None]
            dyn.append("vd")
        if const_expr(self.cfg.has_segments):
            mods.rows = SegmentRows.load(ctx.tScS, ctx.num_rows, m_block * self.tile_m,
                                         mQSeg[batch, None], T, mQBlk[batch, m_block, 0],
                                         mQBlk[batch, m_block, 1])
            mods.kv_seg = mKVSeg[batch, None]
            mods.kv_blk = mKVBlk[batch, None, None]
            mods.S = mK.shape[0]
            dyn += ["rows", "kv_seg", "kv_blk", "S"]
        mods._dynamic = tuple(dyn)
        return self.consume(ctx, mO, mLSE, sO, tma_O, pipe_q, pipe_k, pipe_v, q_state,
                            kv_state, tiled_mma_qk, tiled_mma_pv, tidx, warp_idx, pre_scale,
                            window_left, window_right, blocks, mods, m_block, head, batch,
                            n_min, n_max, seqlen_q, seqlen_k, T)

    @cute.jit
    def consumer_setup(self, sQ, sK, sVt, tiled_mma_qk, tiled_mma_pv, tidx: Int32,
                       scale_log2: Float32):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        c = _ConsumerCtx()
        c.wg = wg
        c.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        c.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        c.tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        c.acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        c.acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.hdv)))
        c.tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((self.tile_m, self.tile_n)))
        c.tScS = TileCoords.make(tiled_mma_qk, tidx, (self.tile_m, self.tile_n))
        c.num_rows = cute.size(layouts.acc_as_rows_cols(c.acc_S), mode=[0])
        c.softmax = OnlineSoftmax(scale_log2, c.num_rows, p_shift_log2=P_SHIFT_LOG2)
        c.tOcO = TileCoords.make(tiled_mma_pv, tidx, (self.tile_m, self.hdv))
        return c

    def segment_compare_needed(self, mods, n_block: Int32):
        """The bf16 kernel's hook before a block's GEMMs are issued; the FP8 kernel reads the
        block's scales there too (k's, and the v scales of this block and the one before), so
        their loads run under the GEMMs instead of stalling the scores after them. Returns
        (the segment answer, k's scale or None, (previous v scale, this one) or None); plain
        Python, inlined while tracing."""
        need = FlashFwdSm90.segment_compare_needed(self, mods, n_block)
        kd = vd = None
        if self.cfg.k_blocks:
            kd = mods.kd[n_block]
        if self.cfg.v_blocks:
            # O holds block n_block + 1's P V in that block's v units; block n_block's PV
            # comes next (right to left). Unused on a tile's first block (O is still 0).
            prev = cutlass.min(n_block + 1, cute.size(mods.vd) - 1)
            vd = (mods.vd[prev], mods.vd[n_block])
        return need, kd, vd

    @cute.jit
    def scores(self, acc_S, tScS, m_block: Int32, n_block: Int32, seqlen_k: Int32,
               pre_scale: Float32, window_left: Int32, window_right: Int32, mods, seg_cmp,
               mask_seqlen: cutlass.Constexpr, mask_right: cutlass.Constexpr,
               mask_left: cutlass.Constexpr, mask_mod: cutlass.Constexpr = False):
        """Block scales first (k: this block's scale, folded into the softmax or multiplied
        onto the scores; v: the ratio by which O changes units before this block's PV, read by
        `softmax_step`), then the bf16 kernel's transforms and masks (a masked -inf stays -inf
        under the folded scale)."""
        need, kd, vd = seg_cmp
        if const_expr(self.cfg.k_blocks and not self.fold_k):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = acc_S[i] * kd
        self._kd_fold = None
        if const_expr(self.fold_k):
            self._kd_fold = kd
        if const_expr(self.cfg.v_blocks):
            self._v_ratio = vd[0] / vd[1]
        FlashFwdSm90.scores(self, acc_S, tScS, m_block, n_block, seqlen_k, pre_scale,
                            window_left, window_right, mods, need, mask_seqlen, mask_right,
                            mask_left, mask_mod)

    def softmax_first(self, softmax, acc_S):
        softmax.step(acc_S, is_first=True, col_scale=self._kd_fold)

    def softmax_step(self, softmax, acc_S):
        """The bf16 kernel's step (with the folded k scale of `scores`, same block); with v
        blocks its O rescale also changes O's units to the coming block's v scale."""
        if self.fold_k:
            row_scale, moved = softmax.step(acc_S, is_first=False, col_scale=self._kd_fold), None
        else:
            row_scale, moved = FlashFwdSm90.softmax_step(self, softmax, acc_S)
        if self.cfg.v_blocks:
            for r in range(softmax.num_rows):
                row_scale[r] = row_scale[r] * self._v_ratio
        return row_scale, moved

    @cute.jit
    def store_o_whole(self, mO, sO, tma_O, pipe_q, q_state, warp_idx: Int32, blocks,
                      m_block: Int32, head: Int32, batch: Int32, st_atom, thr_st, rO):
        """O staged in the loaded-V buffers, or (when smaller than O) in them and the V^T
        buffers after them: the other warpgroup may still be reading V^T in its last PV GEMM,
        so both warpgroups meet first."""
        if const_expr(not self.cfg.o_in_vraw and not self.separate_o):
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        FlashFwdSm90.store_o_whole(self, mO, sO, tma_O, pipe_q, q_state, warp_idx, blocks,
                                   m_block, head, batch, st_atom, thr_st, rO)

    def convert_p(self, acc_S, tOrP):
        """P to e4m3 into the FP8 A registers, in the permuted key order V^T was written in."""
        layouts.fp8_operand_a_values(tOrP).store(
            layouts.acc_as_fp8_operand_a(acc_S).load().to(self.dtype))

    def output_scale(self, c, inv):
        """1 / rowsum times V's descale (one multiply a row instead of one a value)."""
        for r in range(c.num_rows):
            inv[r] = inv[r] * c.v_descale
        return inv
