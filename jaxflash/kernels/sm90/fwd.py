"""FlashAttention forward for Hopper (sm_90a) in the CuTe DSL: `FlashFwdSm90`.

Shape of the kernel (FlashAttention-3's design, written here from the paper and NVIDIA's docs):

- One CTA computes a tile of ``tile_m`` query rows of one (batch, head): 1 producer warpgroup and
  ``tile_m / 64`` consumer warpgroups (2: 384 threads), one CTA per SM (setmaxnreg moves
  registers from the producer, 24, to the consumers, 240).
- Producer: warp 0 issues TMA loads of Q (1-stage pipeline) and K, V (``num_stages`` each) into
  swizzled shared memory, in the order the consumers use them: K[last], Q, then (K[j-1], V[j])
  pairs, then V[first]. Key blocks run right to left so the masked blocks come first.
- Consumers: S = Q K^T by wgmma from shared memory; online softmax in registers with exp2; P
  converted to 16-bit in registers and fed to O += P V as the A operand (RS wgmma). The QK GEMM
  of block j and the PV GEMM of block j+1 are in flight while the softmax of block j runs (FA3
  Alg. 2, intra-warpgroup overlap); two consumer warpgroups (up to hd 128) take turns issuing
  GEMMs (pingpong: named barriers), so one's softmax hides under the other's GEMMs.
- Epilogue: O scaled by 1/rowsum, converted, written to shared memory (Q's buffer) with stmatrix
  and stored by TMA (which clips rows past T); LSE (natural log, float32) written per row.

GQA/MQA: query head n reads K/V head n // (N // K); K/V are never copied. Batch, T, S, heads,
scale, softcap, window bounds, ALiBi slopes and segment ids are runtime values: only `FwdConfig`
fixes the binary. Rows with no visible key produce O = 0 and LSE = -inf.

ALiBi: the slope of the tile's head, divided by the factor the exp2 softmax applies to the
scores (softmax scale, or softcap), is subtracted times |i - j| after the softcap (`mask.py`).
Segment ids: each tile visits only the key blocks [first, end) that XLA precomputed from the
per-block (min, max) ids (`segments.py`), intersected with the causal/window/length range; a
block whose ids are not all one shared segment gets the element compare (`mask.py`).
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
from jaxflash.kernels.common.carry import Carried
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS, L2_SECTION_MB, FwdConfig
from jaxflash.kernels.sm90.fwd_epilogue import FwdEpilogue
from jaxflash.kernels.sm90.fwd_scores import FwdScores
from jaxflash.kernels.common.mask import BlockRange, SegmentRows, TileCoords
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.pipes import TmaPipelines
from jaxflash.kernels.common.scheduler import NUM_SMS, TileScheduler
from jaxflash.kernels.common.softmax import OnlineSoftmax, rescale_rows
from jaxflash.kernels.sm90.tile_handoff import announce_tile, make_tile_pipe, next_tile

LOG2_E = math.log2(math.e)

# Named barrier ids (0 is __syncthreads; 1 and 4 + wg are `fwd_epilogue`'s).
_BAR_WG_SCHED = 2  # 2 + consumer warpgroup index

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}



class _ConsumerCtx(Carried):
    """Per-thread fragments the consumer reuses across tiles."""

    _dynamic = ("wg", "tSrQ", "tSrK", "tOrVt", "acc_S", "acc_O", "tOrP", "tScS", "softmax",
                "tOcO")


class _ScoreMods(Carried):
    """Per-tile inputs of the score transforms: ``alibi`` (slope in score units), ``rows``
    (`SegmentRows`), ``kv_seg`` / ``kv_blk`` (this batch's key ids and block summaries), ``S``.
    Only the present ones are listed in ``_dynamic`` (set per instance)."""


class FlashFwdSm90(FwdEpilogue, FwdScores):
    """Hopper forward attention kernel for one `FwdConfig` variant.

    Host entry (``@cute.jit __call__``), tensors in the canonical jaxflash layouts:
      mQ [B, T, N, H], mK [B, S, K, H], mV [B, S, K, Hv], mO [B, T, N, Hv] (q's dtype, row-major),
      mLSE [B, N, T] float32, mQSeqlen / mKVSeqlen [B] int32 (only when the config has them),
      mAlibi [1, N] float32 (``has_alibi``), mQSeg [B, T], mKVSeg [B, S], mQBlk [B, nm, 4],
      mKVBlk [B, nn, 2] int32 (``has_segments``; see `jaxflash.kernels.common.segments`),
      softmax_scale, softcap (ignored unless ``has_softcap``), window_left / window_right
      (ignored unless ``has_window``; causal alone needs none), stream.
    """

    def __init__(self, config: FwdConfig):
        ok, why = config.check()
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = _DTYPES[config.dtype]
        self.o_dtype = self.dtype  # the output's element type (the FP8 subclass: 16-bit)
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        self.num_mma_wg = config.num_mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 * (self.num_mma_wg + 1)
        # (producer, consumer) registers after setmaxnreg by consumer warpgroups; a raise takes
        # only what the CTA freed (256 rows: 128 x 72 >= 512 x 16 from 96 at launch; 64 rows
        # at two CTAs per SM: 128 at launch).
        self.producer_regs, self.mma_regs = {1: (24, 232), 2: (24, 240), 3: (32, 160),
                                             4: (24, 112)}[self.num_mma_wg]
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window
        # Each block's QK GEMM gets a fresh S fragment at 192 / 256 rows. The wgmma's
        # accumulator operands are read-write even when it zero-fills them, so a reused fragment
        # keeps the previous block's 64 fp32 scores live into it, and LLVM then carries those
        # scores instead of the 16-bit P and converts them only after the QK GEMM is issued: old
        # and new S (128 registers) + P + O. At 160 registers (tile_m 192) that spilled 580 bytes
        # and serialized the wgmma; a fresh fragment's inputs are undefined, so only P stays
        # live. The smaller tiles have the registers and keep the reused fragment.
        self.fresh_s = self.num_mma_wg >= 3
        # The select-form mask saved the last registers at 160 (tile_m 192); other tiles take
        # it with `FwdConfig.mask_select` (the conditional stores' select cascade costs ~14
        # selects per score on every masked block).
        self.mask_by_select = self.num_mma_wg == 3 or config.mask_select
        # Ping-pong needs two warpgroups; FA3 finds it pays up to hdim 128 (beyond, the O
        # accumulator leaves too few registers for two softmaxes in flight to matter).
        self.pingpong = self.num_mma_wg == 2 and self.hd <= 128
        self.persistent = config.persistent
        self.tile_pipe = config.tile_pipe
        self.separate_o = config.separate_o
        self.wg_epilogue = config.wg_epilogue
        self.lazy_rescale = config.lazy_rescale

    @classmethod
    def can_implement(cls, config: FwdConfig) -> tuple[bool, str]:
        return config.check()

    # ------------------------------------------------------------------------------------
    # host
    # ------------------------------------------------------------------------------------
    def launch_layout(self):
        """Names of the launch's tensors, in `__call__` order (see `jaxflash.ffi`)."""
        ins = ["q", "k", "v"]
        ins += mask_inputs(self.cfg)
        ins += ["mod_offsets"] * bool(self.cfg.score_mod or self.cfg.mask_mod)
        ins += ["mod_blocks"] * bool(self.cfg.mask_mod) + [f"aux{i}" for i in range(len(
            self.cfg.aux))]
        return tuple(ins), ("o", "lse"), FLOAT_SCALARS, INT_SCALARS if self.cfg.has_window else ()

    @cute.jit
    def __call__(self, *args):
        """The bridge's order: q, k, v, [q_seqlen], [kv_seqlen], [alibi], [q_seg, kv_seg,
        q_blocks, kv_blocks], o, lse, fscalars, [iscalars], stream (see `jaxflash.ffi`)."""
        a = LaunchArgs(args, f"FlashFwdSm90({self.cfg.key})")
        mQ, mK, mV = a.take(3)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        mAlibi = a.maybe(self.cfg.has_alibi)
        seg = a.maybe(self.cfg.has_segments, 4)
        # mods: (block range table or None, aux arrays, (batch, head) offsets or None)
        mOff = a.maybe(self.has_mods)
        mods = (a.maybe(bool(self.cfg.mask_mod)), a.take(len(self.cfg.aux)) if len(
            self.cfg.aux) > 1 else ((a.take(),) if self.cfg.aux else ()), mOff)
        mO, mLSE, mFScalars = a.take(3)
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch(mQ, mK, mV, mQSeqlen, mKVSeqlen, mAlibi, seg[0], seg[1], seg[2], seg[3], mO,
                    mLSE, mFScalars, mIScalars, stream, mods)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
               mAlibi: Optional[cute.Tensor], mQSeg: Optional[cute.Tensor],
               mKVSeg: Optional[cute.Tensor], mQBlk: Optional[cute.Tensor],
               mKVBlk: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               mFScalars: cute.Tensor,
               mIScalars: Optional[cute.Tensor], stream: cuda.CUstream, mods=(None, (), None)):
        for t in (mQ, mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("lse must be float32")

        # [B, T, N, H] -> (T, H, N, B): the two tiled modes first, as TMA boxes want.
        mQ, mK, mV, mO = [layouts.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = layouts.select_modes(mLSE, [2, 1, 0])  # (T, N, B)

        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN,
            Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.hdv),
            a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hd)
        sK_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hd, self.num_stages)
        sV_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hdv, self.num_stages)
        sO_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hdv)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, self.hd))
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hd), 1)
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.hdv), 1)
        if const_expr(self.wg_epilogue):
            # One store per warpgroup: its 64 rows (in sO, whole 8-row swizzle atoms).
            tma_O, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO,
                layouts.smem_layout(self.dtype, 64, self.hdv), (64, self.hdv))
        else:
            tma_O, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.hdv))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        sq_elems = cute.cosize(sQ_layout)
        if const_expr(cute.cosize(sO_layout) > sq_elems):
            sq_elems = cute.cosize(sO_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            # tile_pipe: 2 slots of (m_block, head, batch, unused) and their full/empty barriers
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 4 if self.tile_pipe else 0]
            tile_coords: cute.struct.MemRange[Int32, 8 if self.tile_pipe else 0]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, sq_elems], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[
                self.dtype, cute.cosize(sO_layout) if self.separate_o else 0], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        T = mQ.shape[0]
        num_m_blocks = (T + self.tile_m - 1) // self.tile_m
        num_heads = mQ.shape[2]
        batch = mQ.shape[3]
        num_tiles = num_m_blocks * num_heads * batch
        scheduler = TileScheduler(lpt=self.cfg.lpt, section_bytes=L2_SECTION_MB * 1024 * 1024,
                                  pairs=self.cfg.tile_order == "pairs")
        grid = num_tiles
        if const_expr(self.persistent):
            grid = cutlass.min(num_tiles, NUM_SMS * self.cfg.ctas_per_sm)

        self.kernel(
            tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, mQSeqlen, mKVSeqlen,
            mAlibi, mQSeg, mKVSeg, mQBlk, mKVBlk, tma_Q, tma_K, tma_V, tma_O, mFScalars, mIScalars,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, scheduler, num_m_blocks, SharedStorage, mods,
        ).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.cfg.ctas_per_sm,
                 preferred_smem_carveout=100 if self.cfg.ctas_per_sm > 1 else None)

    # ------------------------------------------------------------------------------------
    # device
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
        mAlibi: Optional[cute.Tensor], mQSeg: Optional[cute.Tensor],
        mKVSeg: Optional[cute.Tensor], mQBlk: Optional[cute.Tensor],
        mKVBlk: Optional[cute.Tensor],
        tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom, tma_O: cute.CopyAtom,
        mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        scheduler: cutlass.Constexpr, num_m_blocks: Int32,
        SharedStorage: cutlass.Constexpr, mods,
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
        pipe_v = pipes.make(storage.mbar_v.data_ptr(), self.num_stages, self.v_bytes)
        pipe_tile = None
        if const_expr(self.tile_pipe):
            pipe_tile = make_tile_pipe(storage.mbar_tile.data_ptr(), self.num_mma_threads)
        pipes.init_done()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner,
                                       dtype=self.dtype)

        # Runtime scalars (device-resident, so new values never recompile). Softcap folds into
        # the exp2 scale: p = exp2(c * tanh(x * s / c) * log2(e) - ...).
        softmax_scale = mFScalars[0]
        pre_scale = Float32(1.0)
        scale_log2 = softmax_scale * LOG2_E
        # ALiBi slopes are divided by the factor between the scores and the logits (the scale,
        # or the softcap): the bias then rides through the same exp2 FFMA as the scores.
        alibi_unit = softmax_scale
        if const_expr(self.cfg.has_softcap):
            softcap = mFScalars[1]
            pre_scale = softmax_scale / softcap
            scale_log2 = softcap * LOG2_E
            alibi_unit = softcap
        if const_expr(self.has_score_mod):  # the program takes the scaled logit
            pre_scale, scale_log2 = self.mod_scales(softmax_scale)
        alibi_inv = Float32(1.0) / alibi_unit
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
        grid, _, _ = cute.arch.grid_dim()
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]

        pipeline.pipeline_init_wait()
        blk = (mQBlk, mods[0])  # the key-block range tables: segment summaries, mask_mod

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                        self.num_stages)
                if const_expr(self.tile_pipe):
                    sTile = storage.tile_coords.get_tensor(cute.make_layout((4, 2)))
                    tile_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, 2)
                    r = Int32(0)
                    tile = scheduler.tile_of_round(r, bid, grid)
                    # tile_order "pairs": slots, the empty ones (m_block -1) never announced
                    num_slots = num_tiles
                    if const_expr(scheduler.pairs):
                        num_slots = scheduler.num_slots(num_m_blocks, mQ.shape[2], mQ.shape[3])
                    while tile < num_slots:
                        m_block, head, batch = self.tile_coords(tile, scheduler, num_m_blocks,
                                                                mQ, mK)
                        if const_expr(scheduler.pairs):
                            if m_block >= 0:
                                tile_state, q_state, kv_state = self.announce_and_produce(
                                    m_block, head, batch, mQ, mK, mV, mQSeqlen, mKVSeqlen,
                                    blk, blocks, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q,
                                    pipe_k, pipe_v, q_state, kv_state, pipe_tile, sTile,
                                    tile_state)
                        else:
                            tile_state, q_state, kv_state = self.announce_and_produce(
                                m_block, head, batch, mQ, mK, mV, mQSeqlen, mKVSeqlen, blk,
                                blocks, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v,
                                q_state, kv_state, pipe_tile, sTile, tile_state)
                        r += 1
                        tile = scheduler.tile_of_round(r, bid, grid)
                    # m_block -1: no more tiles (the consumers leave their loop).
                    announce_tile(pipe_tile, sTile, tile_state, Int32(-1), Int32(0), Int32(0))
                elif const_expr(self.persistent):
                    r = Int32(0)
                    tile = scheduler.tile_of_round(r, bid, grid)
                    while tile < num_tiles:
                        q_state, kv_state = self.produce_tile(
                            tile, scheduler, num_m_blocks, mQ, mK, mV, mQSeqlen, mKVSeqlen,
                            blk, blocks, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v,
                            q_state, kv_state)
                        r += 1
                        tile = scheduler.tile_of_round(r, bid, grid)
                else:
                    # One tile per CTA: straight-line code (no tile loop around the mainloop).
                    q_state, kv_state = self.produce_tile(
                        bid, scheduler, num_m_blocks, mQ, mK, mV, mQSeqlen, mKVSeqlen, blk,
                        blocks,
                        sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v, q_state,
                        kv_state)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                    self.num_stages)
            if const_expr(self.pingpong):
                if (tidx - 128) // 128 == 0:  # warpgroup 0 issues first
                    cute.arch.barrier_arrive(barrier_id=_BAR_WG_SCHED,
                                             number_of_threads=2 * 128)
            cargs = (mO, mLSE, sQ, sK, sV, sO, tma_O, pipe_q, pipe_k, pipe_v)
            segs = (mAlibi, alibi_inv, mQSeg, mKVSeg, blk, mKVBlk, mods[1:])
            if const_expr(self.tile_pipe):
                sTile = storage.tile_coords.get_tensor(cute.make_layout((4, 2)))
                tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
                m_block, head, batch, tile_state = next_tile(pipe_tile, sTile, tile_state)
                while m_block >= 0:
                    q_state, kv_state = self.consume_at(
                        m_block, head, batch, mQ, mK, mQSeqlen, mKVSeqlen, blocks, cargs, segs,
                        q_state, kv_state, tiled_mma_qk, tiled_mma_pv, tidx - 128, warp_idx,
                        pre_scale, scale_log2, window_left, window_right, T)
                    m_block, head, batch, tile_state = next_tile(pipe_tile, sTile, tile_state)
            elif const_expr(self.persistent):
                r = Int32(0)
                # Tiles of later rounds only grow (also in snake order): stop at the first
                # out-of-range one, so the tile body needs no extra branch around it.
                tile = scheduler.tile_of_round(r, bid, grid)
                while tile < num_tiles:
                    q_state, kv_state = self.consume_tile(
                        tile, scheduler, num_m_blocks, mQ, mK, mQSeqlen, mKVSeqlen, blocks,
                        cargs, segs, q_state, kv_state, tiled_mma_qk, tiled_mma_pv, tidx - 128,
                        warp_idx, pre_scale, scale_log2, window_left, window_right, T)
                    r += 1
                    tile = scheduler.tile_of_round(r, bid, grid)
            else:
                q_state, kv_state = self.consume_tile(
                    bid, scheduler, num_m_blocks, mQ, mK, mQSeqlen, mKVSeqlen, blocks, cargs,
                    segs, q_state, kv_state, tiled_mma_qk, tiled_mma_pv, tidx - 128, warp_idx,
                    pre_scale, scale_log2, window_left, window_right, T)
            if const_expr(self.separate_o):
                # the last stores read sO before the CTA's shared memory goes away
                if warp_idx == 4 or (const_expr(self.wg_epilogue) and warp_idx % 4 == 0):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def announce_and_produce(self, m_block: Int32, head: Int32, batch: Int32, mQ, mK, mV,
                             mQSeqlen, mKVSeqlen, mQBlk, blocks: BlockRange, sQ, sK, sV, tma_Q,
                             tma_K, tma_V, pipe_q, pipe_k, pipe_v, q_state, kv_state, pipe_tile,
                             sTile, tile_state):
        """Tile pipe: hand the consumers a tile's coordinates, then issue its loads."""
        tile_state = announce_tile(pipe_tile, sTile, tile_state, m_block, head, batch)
        q_state, kv_state = self.produce_at(m_block, head, batch, mQ, mK, mV, mQSeqlen,
                                            mKVSeqlen, mQBlk, blocks, sQ, sK, sV, tma_Q, tma_K,
                                            tma_V, pipe_q, pipe_k, pipe_v, q_state, kv_state)
        return tile_state, q_state, kv_state

    @cute.jit
    def produce_tile(self, tile: Int32, scheduler: cutlass.Constexpr, num_m_blocks: Int32,
                     mQ, mK, mV, mQSeqlen, mKVSeqlen, mQBlk, blocks: BlockRange, sQ, sK, sV,
                     tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v, q_state, kv_state):
        m_block, head, batch = self.tile_coords(tile, scheduler, num_m_blocks, mQ, mK)
        return self.produce_at(m_block, head, batch, mQ, mK, mV, mQSeqlen, mKVSeqlen, mQBlk,
                               blocks, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v,
                               q_state, kv_state)

    @cute.jit
    def produce_at(self, m_block: Int32, head: Int32, batch: Int32, mQ, mK, mV, mQSeqlen,
                   mKVSeqlen, mQBlk, blocks: BlockRange, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q,
                   pipe_k, pipe_v, q_state, kv_state):
        n_min, n_max, _sq, _sk = self.tile_bounds(m_block, head, batch, mQ, mK, mQSeqlen,
                                                  mKVSeqlen, mQBlk, blocks)
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        return self.produce(mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v,
                            q_state, kv_state, m_block, head, kv_head, batch, n_min, n_max,
                            blocks)

    @cute.jit
    def consume_tile(self, tile: Int32, scheduler: cutlass.Constexpr, num_m_blocks: Int32,
                     mQ, mK, mQSeqlen, mKVSeqlen, blocks: BlockRange, cargs, segs, q_state,
                     kv_state, tiled_mma_qk, tiled_mma_pv, tidx: Int32, warp_idx: Int32,
                     pre_scale: Float32, scale_log2: Float32, window_left: Int32,
                     window_right: Int32, T: Int32):
        m_block, head, batch = self.tile_coords(tile, scheduler, num_m_blocks, mQ, mK)
        return self.consume_at(m_block, head, batch, mQ, mK, mQSeqlen, mKVSeqlen, blocks, cargs,
                               segs, q_state, kv_state, tiled_mma_qk, tiled_mma_pv, tidx,
                               warp_idx, pre_scale, scale_log2, window_left, window_right, T)

    @cute.jit
    def consume_at(self, m_block: Int32, head: Int32, batch: Int32, mQ, mK, mQSeqlen,
                   mKVSeqlen, blocks: BlockRange, cargs, segs, q_state, kv_state, tiled_mma_qk,
                   tiled_mma_pv, tidx: Int32, warp_idx: Int32, pre_scale: Float32,
                   scale_log2: Float32, window_left: Int32, window_right: Int32, T: Int32):
        mO, mLSE, sQ, sK, sV, sO, tma_O, pipe_q, pipe_k, pipe_v = cargs
        mAlibi, alibi_inv, mQSeg, mKVSeg, blk, mKVBlk, (aux, mOff) = segs
        mQBlk = blk[0]
        n_min, n_max, seqlen_q, seqlen_k = self.tile_bounds(m_block, head, batch, mQ, mK,
                                                            mQSeqlen, mKVSeqlen, blk, blocks)
        # Fragments are made per tile, inside the tile's own region: accumulators carried
        # through the persistent tile loop would cost register copies around in-flight wgmma.
        ctx = self.consumer_setup(sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, tidx, scale_log2)
        mods = _ScoreMods()
        dyn = []
        if const_expr(self.cfg.has_alibi):
            mods.alibi = mAlibi[0, head] * alibi_inv
            dyn.append("alibi")
        if const_expr(self.cfg.has_segments):
            mods.rows = SegmentRows.load(ctx.tScS, ctx.num_rows, m_block * self.tile_m,
                                         mQSeg[batch, None], T, mQBlk[batch, m_block, 0],
                                         mQBlk[batch, m_block, 1])
            mods.kv_seg = mKVSeg[batch, None]
            mods.kv_blk = mKVBlk[batch, None, None]
            mods.S = mK.shape[0]
            dyn += ["rows", "kv_seg", "kv_blk", "S"]
        if const_expr(self.has_mods):
            # the mods see global indices (a shard's offsets added)
            mods.batch, mods.head, mods.aux = batch + mOff[0], head + mOff[1], aux
            dyn += ["batch", "head", "aux"]
        if const_expr(self.has_mask_mod):
            _n0, mods.full_lo, mods.full_hi, _n1 = self.mod_row(blk[1], batch, head, m_block)
            dyn += ["full_lo", "full_hi"]
        mods._dynamic = tuple(dyn)
        return self.consume(ctx, mO, mLSE, sO, tma_O, pipe_q, pipe_k, pipe_v, q_state,
                            kv_state, tiled_mma_qk, tiled_mma_pv, tidx, warp_idx, pre_scale,
                            window_left, window_right, blocks, mods, m_block, head, batch,
                            n_min, n_max, seqlen_q, seqlen_k, T)

    @cute.jit
    def tile_coords(self, tile: Int32, scheduler: cutlass.Constexpr, num_m_blocks: Int32, mQ,
                    mK):
        """(m_block, head, batch) of a linear tile index."""
        S = mK.shape[0]
        kv_bytes_per_head = S * (self.hd + self.hdv) * (self.dtype.width // 8)
        return scheduler.decode(tile, num_m_blocks, mQ.shape[2], mQ.shape[3], kv_bytes_per_head)

    @cute.jit
    def tile_bounds(self, m_block: Int32, head: Int32, batch: Int32, mQ, mK, mQSeqlen,
                    mKVSeqlen, blk, blocks: BlockRange):
        """(n_min, n_max, seqlen_q, seqlen_k) of a tile: its key-block range and its batch's
        lengths; producer and consumers compute the same values."""
        T = mQ.shape[0]
        S = mK.shape[0]
        seqlen_q = T
        if const_expr(mQSeqlen is not None):
            seqlen_q = cutlass.max(cutlass.min(T, mQSeqlen[batch]), 0)
        seqlen_k = S
        if const_expr(mKVSeqlen is not None):
            seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
        n_min, n_max = blocks.n_block_min_max(m_block, seqlen_q, seqlen_k)
        mQBlk, mModBlk = blk
        if const_expr(mModBlk is not None):  # mask_mod: the blocks it leaves visible
            lo, _fl, _fh, hi = self.mod_row(mModBlk, batch, head, m_block)
            n_min = cutlass.max(n_min, lo)
            n_max = cutlass.min(n_max, hi)
        if const_expr(mQBlk is not None):
            # Segment block skipping: only key blocks whose ids can meet this tile's (exact for
            # sorted, document-packed ids; see `jaxflash.kernels.common.segments`).
            n_min = cutlass.max(n_min, mQBlk[batch, m_block, 2])
            n_max = cutlass.min(n_max, mQBlk[batch, m_block, 3])
        if blocks.first_row(m_block) >= seqlen_q:
            n_max = n_min  # every row of the tile is past the query length: nothing to load
        return n_min, n_max, seqlen_q, seqlen_k

    @cute.jit
    def produce(self, mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v,
                q_state, kv_state, m_block: Int32, head: Int32, kv_head: Int32, batch: Int32,
                n_min: Int32, n_max: Int32, blocks: BlockRange):
        """Issue one tile's loads; returns the advanced (q_state, kv_state)."""
        gQ = blocks.row_box(mQ[None, None, head, batch], m_block, self.hd)
        gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.hd), (None, 0))
        gV = cute.local_tile(mV[None, None, kv_head, batch], (self.tile_n, self.hdv), (None, 0))
        tQsQ, tQgQ = layouts.tma_tiles(tma_Q, sQ, gQ)
        tKsK, tKgK = layouts.tma_tiles(tma_K, sK, gK)
        tVsV, tVgV = layouts.tma_tiles(tma_V, sV, gV)
        n = n_max - 1
        if n_max > n_min:
            # K of the first (rightmost) block before Q: with a persistent CTA, Q's buffer may
            # still be held by the previous tile's epilogue while K can already stream in.
            pipe_k.producer_acquire(kv_state)
            cute.copy(tma_K, tKgK[None, n], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
        # Q is loaded for every tile (even one with no visible key), so the Q/O buffer handshake
        # with the consumers is the same for every tile.
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        if n_max > n_min:
            # The consumers use K[j-1] before V[j]: load in that order.
            for i in cutlass.range(n_max - 1 - n_min, unroll=1):
                n_prev = n_max - 1 - i
                prev_state = kv_state.clone()
                kv_state.advance()
                pipe_k.producer_acquire(kv_state)
                cute.copy(tma_K, tKgK[None, n_prev - 1], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_v.producer_acquire(prev_state)
                cute.copy(tma_V, tVgV[None, n_prev], tVsV[None, prev_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(prev_state))
            pipe_v.producer_acquire(kv_state)
            cute.copy(tma_V, tVgV[None, n_min], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
            kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def consumer_setup(self, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, tidx: Int32,
                       scale_log2: Float32):
        """Register fragments and partitions a consumer thread reuses for every tile."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        c = _ConsumerCtx()
        c.wg = wg
        c.tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        c.tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        c.tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(layouts.transpose_mn(sV)))
        c.acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        c.acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.hdv)))
        c.tOrP = cute.make_rmem_tensor_like(layouts.acc_as_operand_a(c.acc_S), self.dtype)
        c.tScS = TileCoords.make(tiled_mma_qk, tidx, (self.tile_m, self.tile_n))
        c.num_rows = cute.size(layouts.acc_as_rows_cols(c.acc_S), mode=[0])
        c.softmax = OnlineSoftmax(scale_log2, c.num_rows)
        # Epilogue partitions, derived before the mainloop mutates anything.
        c.tOcO = TileCoords.make(tiled_mma_pv, tidx, (self.tile_m, self.hdv))
        return c

    @cute.jit
    def consume(self, c, mO, mLSE, sO, tma_O, pipe_q, pipe_k, pipe_v, q_state, kv_state,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tidx: Int32,
                warp_idx: Int32, pre_scale: Float32, window_left: Int32, window_right: Int32,
                blocks: BlockRange, mods, m_block: Int32, head: Int32, batch: Int32, n_min: Int32,
                n_max: Int32, seqlen_q: Int32, seqlen_k: Int32, T: Int32):
        """One tile: mainloop over its key blocks, then the epilogue. Returns the advanced
        (q_state, kv_state)."""
        wg = c.wg
        tSrQ, tSrK, tOrVt = c.tSrQ, c.tSrK, c.tOrVt
        acc_S, acc_O, tOrP, tScS = c.acc_S, c.acc_O, c.tOrP, c.tScS
        softmax = c.softmax
        acc_O.fill(0.0)
        softmax.row_max.fill(-Float32.inf)
        softmax.row_sum.fill(0.0)

        pipe_q.consumer_wait(q_state)
        if n_max > n_min:
            mm = bool(self.cfg.mask_mod)  # the partial blocks evaluate the mask_mod
            step = lambda st, n, ms, mr, ml, mm=False: self.one_block(
                st, n, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, acc_S,
                acc_O, tOrP, tScS, softmax, wg, m_block, seqlen_k, pre_scale, window_left,
                window_right, mods, ms, mr, ml, mm)

            n = n_max - 1
            # First half block: S and P of the rightmost block only.
            seg_cmp = self.segment_compare_needed(mods, n)
            pipe_k.consumer_wait(kv_state)
            layouts.wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                          zero_init=True, wait=0, clear=self.persistent)
            pipe_k.consumer_release(kv_state)
            self.scores(acc_S, tScS, m_block, n, seqlen_k, pre_scale, window_left,
                        window_right, mods, seg_cmp, True, self.has_right, self.has_left, mm)
            self.softmax_first(softmax, acc_S)
            self.convert_p(acc_S, tOrP)
            # Blocks cut by the right (causal/window) bound.
            n_right = self.mod_right(mods, blocks.n_block_min_right_mask(m_block, n_min))
            count = cutlass.max(n - n_right, 0)
            for i in cutlass.range(count, unroll=1):
                kv_state = step(kv_state, n - 1 - i, False, self.has_right, self.has_left, mm)
            n = n - count
            # Fully visible blocks.
            n_left = self.mod_left(mods, blocks.n_block_min_no_left_mask(m_block, n_min))
            count = cutlass.max(n - n_left, 0)
            for i in cutlass.range(count, unroll=1):
                kv_state = step(kv_state, n - 1 - i, False, False, False)
            n = n - count
            # Blocks cut by the window's left bound (or partial for the mask_mod).
            if const_expr(self.has_left or mm):
                count = cutlass.max(n - n_min, 0)
                for i in cutlass.range(count, unroll=1):
                    kv_state = step(kv_state, n - 1 - i, False, self.has_right, self.has_left,
                                    mm)
            if const_expr(self.separate_o):
                pipe_q.consumer_release(q_state)  # last QK GEMM done: the next Q may load
            # Last half block: O += P V of the leftmost block.
            pipe_v.consumer_wait(kv_state)
            layouts.wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index],
                          zero_init=False, wait=0)
            pipe_v.consumer_release(kv_state)
            kv_state.advance()
        else:
            if const_expr(self.separate_o):
                pipe_q.consumer_release(q_state)

        self.finish_tile(c, mO, mLSE, sO, tma_O, pipe_q, q_state, tiled_mma_pv, tidx, warp_idx,
                         blocks, m_block, head, batch, seqlen_q, T)
        q_state.advance()
        return q_state, kv_state

    @cute.jit
    def one_block(self, kv_state, n_block: Int32, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                  tSrQ, tSrK, tOrVt, acc_S, acc_O, tOrP, tScS, softmax: cutlass.Constexpr,
                  wg: Int32, m_block: Int32, seqlen_k: Int32, pre_scale: Float32,
                  window_left: Int32, window_right: Int32, mods, mask_seqlen: cutlass.Constexpr,
                  mask_right: cutlass.Constexpr, mask_left: cutlass.Constexpr,
                  mask_mod: cutlass.Constexpr = False):
        """One key block: S_j = Q K_j^T and O += P_{j+1} V_{j+1} in flight together, softmax
        of S_j under the PV GEMM. Returns the advanced pipeline state."""
        if const_expr(self.fresh_s):
            acc_S = cute.make_rmem_tensor_like(acc_S)
        v_state = kv_state.clone()
        kv_state.advance()
        seg_cmp = self.segment_compare_needed(mods, n_block)
        pipe_k.consumer_wait(kv_state)
        self.sched_sync(wg)
        layouts.wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                      zero_init=True, wait=-1, clear=self.persistent)
        pipe_v.consumer_wait(v_state)
        layouts.wgmma(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index],
                      zero_init=False, wait=-1)
        self.sched_arrive(wg)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(kv_state)
        self.scores(acc_S, tScS, m_block, n_block, seqlen_k, pre_scale, window_left,
                    window_right, mods, seg_cmp, mask_seqlen, mask_right, mask_left, mask_mod)
        row_scale, moved = self.softmax_step(softmax, acc_S)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        # P's registers are free only now that the PV GEMM reading them is done.
        self.convert_p(acc_S, tOrP)
        self.rescale_o(acc_O, row_scale, moved)
        return kv_state

    def convert_p(self, acc_S, tOrP):
        """P (the exponentiated S accumulator) into the PV GEMM's A-operand registers: the
        16-bit A fragment is a re-view of the accumulator. Plain Python (inlined while tracing);
        the FP8 subclass reorders instead."""
        tOrP.store(layouts.acc_as_operand_a(acc_S).load().to(self.dtype))

    def softmax_first(self, softmax, acc_S):
        """The softmax of a tile's first block (plain Python, inlined while tracing)."""
        softmax.step(acc_S, is_first=True)

    def softmax_step(self, softmax, acc_S):
        """(row_scale, whether the warp must rescale O: None = always) of a non-first block.
        Plain Python (inlined while tracing)."""
        if const_expr(self.lazy_rescale):
            return softmax.step_lazy(acc_S)
        return softmax.step(acc_S, is_first=False), None

    @cute.jit
    def rescale_o(self, acc_O, row_scale, moved):
        if const_expr(moved is None):
            rescale_rows(acc_O, row_scale)
        else:
            if moved:  # warp-uniform: no row of the warp moved its reference, nothing to do
                rescale_rows(acc_O, row_scale)

    @cute.jit
    def sched_sync(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_BAR_WG_SCHED + wg, number_of_threads=2 * 128)

    @cute.jit
    def sched_arrive(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=_BAR_WG_SCHED + (1 - wg),
                                     number_of_threads=2 * 128)
