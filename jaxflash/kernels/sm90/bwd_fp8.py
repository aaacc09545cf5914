"""FP8 FlashAttention backward for Hopper (sm_90a): `FlashBwdSm90Fp8`.

The bf16 backward's scheme (`sm90.bwd.FlashBwdSm90`: one CTA per 128-key block, keys as the
wgmma M dimension, dK / dV in registers over the CTA's walk of query blocks, dQ added to a
float32 accumulator by one bulk reduce a step) with E4M3 Q, K, V, P and dS, E5M2 dO and float32
accumulation, by the numerics contract of `jaxflash.fp8.contract`. What differs and why:

- FP8 wgmma reads only K-major operands. S^T = K Q^T and dP^T = V dO^T are (the head dim is
  their k index); the other three GEMMs sum over queries or keys, so they read transposed
  copies written by XLA in the pass that quantizes dO (`bwd_fp8_launch`): dV += P^T dO and
  dK += dS^T Q take dO^T and Q^T (head dim x queries), dQ = dS K takes K^T (head dim x keys).
  A copy made where the tensor is read and written anyway costs one byte an element of DRAM
  traffic; a transpose in shared memory (as the forward's V) would cost the producer
  warpgroup two tiles a step here (Q and dO change every step), where the forward moves one
  tile per key block.
- P^T and dS^T feed dV and dK as register A operands without data exchange: the A position
  16c + 4q + i of an FP8 k-block is given query 16c + 2q + i % 2 + 8 (i // 2) (the thread's own
  accumulator columns, `layouts.acc_as_fp8_operand_a`), and Q^T / dO^T arrive with their query
  columns in that order.
- dS goes to shared memory (queries x keys, keys contiguous: the dQ GEMM's K-major A) in 16-bit
  stores: a thread holds keys r and r + 8 of each of its query columns, so key position
  16w + 2a + b is given key 16w + a + 8b (a < 8, b < 2), and K^T arrives with its key columns in
  that order (the products sum over keys: a common permutation leaves dQ unchanged).
- Scales: the step's q and k descales fold into the exp2 scale (or the softcap pre-scale), P
  is exp2(...) x 2^8 (the lse shifted by 8: the contract's P_SCALE_LOG2), dP^T's v and dO
  descales into the one FMA that subtracts delta. dS takes one scale per 64 x 128 block, the
  amax of |dS| over both consumer warpgroups (warp shuffles, one float a warp through shared
  memory, one named barrier), the contract's amax rule. dV and dK accumulate in the units of
  the current step (dO's scale; dS's x q's): when they change, the accumulator is multiplied by
  the ratio of the old to the new unit before the GEMM (one FMUL a register), and the epilogue
  applies the last unit. dQ's tile is multiplied by its step's dS x k scale before the flush.
- dK and dV leave as float32 (the contract's gradients), stored from registers (rows past S
  dropped): the FP8 K / V buffers are too small to stage them.
- The dV GEMM is issued before the dS amax barrier, so the barrier waits behind it.

Masks (causal, window, lengths, segment ids) and softcap are the bf16 kernel's code
(`mask.py`, `segments.py`). Gated unverified (`policy/verified.RULES`) until its GPU check.

Head dim 256 runs the subclass `sm90.bwd_fp8_wide.FlashBwdSm90Fp8Wide` (the head-dim split of
the bf16 `FlashBwdSm90Wide`): it replaces `fp8_tiled_mmas`, `ds_buffers` and `consume_fp8` and
keeps the rest (launch, producer, `probs_grads`, `store_ds`, `store_dkdv_f32`).
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int16, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import cpasync, warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.dq_order import zero_fill
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.mask import (QueryBlockRange, SegmentRows, TileCoords,
                                          apply_mask_kq, apply_segment_mask)
from jaxflash.kernels.common.pipes import TmaPipelines
from jaxflash.kernels.sm90.bwd import _BAR_DS, _BAR_EPILOGUE, FlashBwdSm90
from jaxflash.kernels.variants.bwd import FLOAT_SCALARS, INT_SCALARS
from jaxflash.kernels.variants.bwd_fp8 import AMAX_FLOOR, DESCALES, Fp8BwdConfig

LOG2_E = math.log2(math.e)
# `jaxflash.fp8.contract` (a sibling layer): P_SCALE_LOG2 and E4M3_MAX; the compile test holds
# them equal.
P_SHIFT_LOG2 = 8
E4M3_MAX = 448.0
# Named barrier: every consumer warp's |dS| max is in shared memory (ids 1-3: `sm90.bwd`).
_BAR_AMAX = 4

_FP8 = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}


@dsl_user_op
def cvt_e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int16:
    """Two floats to two e4m3 bytes in one 16-bit word (``lo`` the low byte), saturating, round
    to nearest even: the contract's convert."""
    res = llvm.inline_asm(
        Int16.mlir_type,
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int16(res)


@dsl_user_op
def cvt_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None,
               ip=None) -> Int32:
    """Four floats to four e4m3 bytes in one 32-bit word (``a`` the lowest byte), as
    `cvt_e4m3x2`."""
    res = llvm.inline_asm(
        Int32.mlir_type,
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(res)


class FlashBwdSm90Fp8(FlashBwdSm90):
    """Hopper FP8 backward for one `Fp8BwdConfig` variant.

    Host entry, the bridge's order (`bwd_fp8_launch`): q, k, v, do, qt, kt, dot, lse2, delta,
    [q_seqlen], [kv_seqlen], [q_segment_ids, kv_segment_ids, kv_blocks, q_blocks], q_descale,
    do_descale, k_descale, v_descale, dq_acc, dk, dv, fscalars, [iscalars], stream.
    """

    # tile_m x tile_n FP8 tiles in the dS buffer: dS, twice (the dQ GEMM of step i reads one
    # while step i + 1 writes the other)
    ds_buffers = 2

    def __init__(self, config: Fp8BwdConfig):
        ok, why = config.check()
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = _FP8[config.dtype]
        self.do_dtype = _FP8[config.do_dtype]
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        self.num_mma_wg = 2
        self.num_mma_threads = 256
        self.num_threads = 384
        self.producer_regs, self.mma_regs = 24, 240
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window
        self.dq_flat, self.dq_box = True, False
        # the dQ GEMM (64 queries) splits the head dim over the two warpgroups
        self.dq_atoms = (1, 2, 1)
        self.dq_cols = self.hd // 2

    @classmethod
    def can_implement(cls, config: Fp8BwdConfig) -> tuple[bool, str]:
        return config.check()

    def launch_layout(self):
        ins = ["q", "k", "v", "do", "qt", "kt", "dot", "lse2", "delta"]
        ins += mask_inputs(self.cfg, backward=True)
        ins += list(DESCALES)
        return (tuple(ins), ("dq_acc", "dk", "dv"), FLOAT_SCALARS,
                INT_SCALARS if self.cfg.has_window else ())

    def fp8_tiled_mmas(self):
        """(S^T, dP^T, dK, dV, dQ) tiled MMAs, every operand K-major. Plain Python."""
        K_ = cute.nvgpu.OperandMajorMode.K
        e4, e5 = self.dtype, self.do_dtype
        # S^T = K Q^T, dP^T = V dO^T: M = keys (64 per warpgroup), N = queries, k = head dim
        mma_s = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, (2, 1, 1),
                                                     (64, self.tile_m))
        mma_dp = sm90_helpers.make_trivial_tiled_mma(e4, e5, K_, K_, Float32, (2, 1, 1),
                                                      (64, self.tile_m))
        # dK += dS^T Q, dV += P^T dO: A from registers (k = queries), B = Q^T / dO^T
        rm = warpgroup.OperandSource.RMEM
        mma_dk = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, (2, 1, 1),
                                                      (64, self.hd), a_source=rm)
        mma_dv = sm90_helpers.make_trivial_tiled_mma(e4, e5, K_, K_, Float32, (2, 1, 1),
                                                      (64, self.hdv), a_source=rm)
        # dQ = dS K: A = dS (queries x key positions), B = K^T; warpgroups split the head dim
        mma_dq = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, self.dq_atoms,
                                                      (64, self.dq_cols))
        return mma_s, mma_dp, mma_dk, mma_dv, mma_dq

    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashBwdSm90Fp8({self.cfg.key})")
        mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE, mDelta = a.take(9)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        seg = a.maybe(self.cfg.has_segments, 4)
        mQD, mdOD, mKD, mVD = a.take(4)
        mdQ, mdK, mdV, mFScalars = a.take(4)
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch_fp8((mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE, mDelta), mQSeqlen, mKVSeqlen,
                        seg, (mQD, mdOD, mKD, mVD), mdQ, mdK, mdV, mFScalars, mIScalars, stream)

    @cute.jit
    def launch_fp8(self, ins, mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
                   seg, descales, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                   mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor],
                   stream: cuda.CUstream):
        mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE, mDelta = ins
        for t in (mQ, mK, mV, mQt, mKt):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        for t in (mdO, mdOt):
            if const_expr(t.element_type != self.do_dtype):
                raise TypeError(f"dO must be {self.do_dtype}, got {t.element_type}")
        for t in (mLSE, mDelta, mdQ, mdK, mdV) + tuple(descales):
            if const_expr(t.element_type != Float32):
                raise TypeError("lse2, delta, the descales, dq_acc, dk and dv must be float32")
        zero_fill(mdQ, stream)

        # [B, T, N, H] -> (T, H, N, B); the transposed copies [B, N, H, Tp] -> (H, Tp, N, B)
        mQ, mK, mV, mdO, mdK, mdV = [layouts.select_modes(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mQt, mKt, mdOt = [layouts.select_modes(t, [2, 3, 1, 0]) for t in (mQt, mKt, mdOt)]
        mLSE, mDelta = [layouts.select_modes(t, [2, 1, 0]) for t in (mLSE, mDelta)]

        e4, e5 = self.dtype, self.do_dtype
        mma_s, mma_dp, mma_dk, mma_dv, mma_dq = self.fp8_tiled_mmas()

        st = self.num_stages
        sQ_l = layouts.smem_layout(e4, self.tile_m, self.hd, st)
        sQt_l = layouts.smem_layout(e4, self.hd, self.tile_m, st)
        sdO_l = layouts.smem_layout(e5, self.tile_m, self.hdv, st)
        sdOt_l = layouts.smem_layout(e5, self.hdv, self.tile_m, st)
        sK_l = layouts.smem_layout(e4, self.tile_n, self.hd)
        sV_l = layouts.smem_layout(e4, self.tile_n, self.hdv)
        sKt_l = layouts.smem_layout(e4, self.hd, self.tile_n)
        sdS_l = layouts.smem_layout(e4, self.tile_m, self.tile_n, self.ds_buffers)
        sRow_l = self.row_layout()
        sdQ_l = self.dq_flat_layout()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sel = lambda l: cute.select(l, mode=[0, 1])
        tma_Q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sel(sQ_l), (self.tile_m, self.hd), 1)
        tma_Qt, tma_mQt = cpasync.make_tiled_tma_atom(g2s, mQt, sel(sQt_l),
                                                      (self.hd, self.tile_m), 1)
        tma_dO, tma_mdO = cpasync.make_tiled_tma_atom(g2s, mdO, sel(sdO_l),
                                                      (self.tile_m, self.hdv), 1)
        tma_dOt, tma_mdOt = cpasync.make_tiled_tma_atom(g2s, mdOt, sel(sdOt_l),
                                                        (self.hdv, self.tile_m), 1)
        tma_K, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_l, (self.tile_n, self.hd))
        tma_V, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_l, (self.tile_n, self.hdv))
        tma_Kt, tma_mKt = cpasync.make_tiled_tma_atom(g2s, mKt, sKt_l, (self.hd, self.tile_n))
        row1 = cute.select(sRow_l, mode=[0])
        tma_LSE, tma_mLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, row1, (self.tile_m,), 1)
        tma_Dl, tma_mDelta = cpasync.make_tiled_tma_atom(g2s, mDelta, row1, (self.tile_m,), 1)
        self.q_bytes = (cute.size_in_bytes(e4, sel(sQ_l)) + cute.size_in_bytes(e4, sel(sQt_l))
                        + self.tile_m * 4)
        self.do_bytes = (cute.size_in_bytes(e5, sel(sdO_l))
                         + cute.size_in_bytes(e5, sel(sdOt_l)) + self.tile_m * 4)
        self.kv_bytes = (cute.size_in_bytes(e4, sK_l) + cute.size_in_bytes(e4, sV_l)
                         + cute.size_in_bytes(e4, sKt_l))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_l)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_l)], 128]
            sAmax: cute.struct.Align[cute.struct.MemRange[Float32, 16], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sQ_l)], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sQt_l)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[e5, cute.cosize(sdO_l)], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[e5, cute.cosize(sdOt_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sV_l)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sKt_l)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[e4, cute.cosize(sdS_l)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_l)], 1024]

        S = mK.shape[0]
        num_n_blocks = (S + self.tile_n - 1) // self.tile_n
        self.kernel_fp8(
            (tma_mQ, tma_mK, tma_mV, tma_mdO, tma_mQt, tma_mKt, tma_mdOt, tma_mLSE, tma_mDelta),
            (tma_Q, tma_K, tma_V, tma_dO, tma_Qt, tma_Kt, tma_dOt, tma_LSE, tma_Dl),
            mQSeqlen, mKVSeqlen, seg, descales, mdQ, mdK, mdV, mFScalars, mIScalars,
            (sQ_l, sQt_l, sdO_l, sdOt_l, sK_l, sV_l, sKt_l, sdS_l, sRow_l, sdQ_l),
            (mma_s, mma_dp, mma_dk, mma_dv, mma_dq), SharedStorage,
        ).launch(grid=[num_n_blocks, mK.shape[2], mK.shape[3]], block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel_fp8(self, gm, atoms, mQSeqlen: Optional[cute.Tensor],
                   mKVSeqlen: Optional[cute.Tensor], seg, descales, mdQ: cute.Tensor,
                   mdK: cute.Tensor, mdV: cute.Tensor, mFScalars: cute.Tensor,
                   mIScalars: Optional[cute.Tensor], lays, mmas,
                   SharedStorage: cutlass.Constexpr):
        mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE, mDelta = gm
        sQ_l, sQt_l, sdO_l, sdOt_l, sK_l, sV_l, sKt_l, sdS_l, sRow_l, sdQ_l = lays
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipes = TmaPipelines(self.num_mma_threads)
        pipe_kv = pipes.make(storage.mbar_kv.data_ptr(), 1, self.kv_bytes)
        pipe_q = pipes.make(storage.mbar_q.data_ptr(), self.num_stages, self.q_bytes)
        pipe_do = pipes.make(storage.mbar_do.data_ptr(), self.num_stages, self.do_bytes)
        pipes.init_done()

        g = lambda buf, l: buf.get_tensor(l.outer, swizzle=l.inner)
        sm = (g(storage.sQ, sQ_l), g(storage.sQt, sQt_l), g(storage.sdO, sdO_l),
              g(storage.sdOt, sdOt_l), g(storage.sK, sK_l), g(storage.sV, sV_l),
              g(storage.sKt, sKt_l), g(storage.sdS, sdS_l), storage.sLSE.get_tensor(sRow_l),
              storage.sDelta.get_tensor(sRow_l), g(storage.sdQ, sdQ_l),
              storage.sAmax.get_tensor(cute.make_layout((8, 2))),
              storage.sdS.get_tensor(cute.make_layout(cute.cosize(sdS_l) // 2), dtype=Int16),
              sdS_l)

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
        S = mK.shape[0]
        n_block, kv_head, batch = cute.arch.block_idx()
        group = mQ.shape[2] // mK.shape[2]
        seqlen_q = T
        if const_expr(mQSeqlen is not None):
            seqlen_q = cutlass.max(cutlass.min(T, mQSeqlen[batch]), 0)
        seqlen_k = S
        if const_expr(mKVSeqlen is not None):
            seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
        blocks = QueryBlockRange(self.tile_m, self.tile_n, self.has_right, self.has_left,
                                 window_left, window_right)
        m_min, m_max = blocks.m_block_min_max(n_block, seqlen_q, seqlen_k)
        if const_expr(self.cfg.has_segments):
            m_min = cutlass.max(m_min, seg[2][batch, n_block, 2])
            m_max = cutlass.max(cutlass.min(m_max, seg[2][batch, n_block, 3]), m_min)
        num_m = m_max - m_min
        num_steps = group * num_m

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce_fp8(gm, atoms, sm, pipe_kv, pipe_q, pipe_do, n_block, kv_head,
                                 batch, group, m_min, num_m, num_steps)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume_fp8(mdQ, mdK, mdV, sm, pipe_kv, pipe_q, pipe_do, mmas, tidx - 128,
                             warp_idx, softmax_scale, pre_scale, scale_log2, window_left,
                             window_right, n_block, kv_head, batch, group, m_min, num_m,
                             num_steps, seqlen_k, S, T, blocks, seg, descales)

    @cute.jit
    def produce_fp8(self, gm, atoms, sm, pipe_kv, pipe_q, pipe_do, n_block: Int32,
                    kv_head: Int32, batch: Int32, group: Int32, m_min: Int32, num_m: Int32,
                    num_steps: Int32):
        """Warp 0: K, V and K^T once, then (Q + Q^T + LSE, dO + dO^T + delta) per step."""
        mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE, mDelta = gm
        tma_Q, tma_K, tma_V, tma_dO, tma_Qt, tma_Kt, tma_dOt, tma_LSE, tma_Dl = atoms
        sQ, sQt, sdO, sdOt, sK, sV, sKt, _sdS, sLSE, sDelta = sm[:10]
        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            gK = cute.local_tile(mK[None, None, kv_head, batch], (self.tile_n, self.hd),
                                 (n_block, 0))
            gV = cute.local_tile(mV[None, None, kv_head, batch], (self.tile_n, self.hdv),
                                 (n_block, 0))
            gKt = cute.local_tile(mKt[None, None, kv_head, batch], (self.hd, self.tile_n),
                                  (0, n_block))
            pipe_kv.producer_acquire(kv_state)
            kv_bar = pipe_kv.producer_get_barrier(kv_state)
            self.tma_whole(tma_K, sK, gK, kv_bar)
            self.tma_whole(tma_V, sV, gV, kv_bar)
            self.tma_whole(tma_Kt, sKt, gKt, kv_bar)

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            for step in cutlass.range(num_steps, unroll=1):
                gi = step // num_m
                m_block = m_min + step - gi * num_m
                head = kv_head * group + gi
                gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hd),
                                     (None, 0))
                gQt = cute.local_tile(mQt[None, None, head, batch], (self.hd, self.tile_m),
                                      (0, None))
                gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdv),
                                      (None, 0))
                gdOt = cute.local_tile(mdOt[None, None, head, batch], (self.hdv, self.tile_m),
                                       (0, None))
                gL = cute.local_tile(mLSE[None, head, batch], (self.tile_m,), (None,))
                gD = cute.local_tile(mDelta[None, head, batch], (self.tile_m,), (None,))
                pipe_q.producer_acquire(state)
                q_bar = pipe_q.producer_get_barrier(state)
                self.tma_stage(tma_Q, sQ, gQ, m_block, state.index, q_bar, 2)
                self.tma_stage(tma_Qt, sQt, gQt, m_block, state.index, q_bar, 2)
                self.tma_stage(tma_LSE, sLSE, gL, m_block, state.index, q_bar, 1)
                pipe_do.producer_acquire(state)
                do_bar = pipe_do.producer_get_barrier(state)
                self.tma_stage(tma_dO, sdO, gdO, m_block, state.index, do_bar, 2)
                self.tma_stage(tma_dOt, sdOt, gdOt, m_block, state.index, do_bar, 2)
                self.tma_stage(tma_Dl, sDelta, gD, m_block, state.index, do_bar, 1)
                state.advance()

    def tma_whole(self, atom, sT, gT, bar):
        """One TMA load of a whole (single-stage) tile. Plain Python (inlined)."""
        tS, tG = layouts.tma_tiles(atom, sT, gT)
        cute.copy(atom, tG, tS, tma_bar_ptr=bar)

    def tma_stage(self, atom, sT, gT, block, stage, bar, rank: int):
        """One TMA load of tile `block` of gT into stage `stage` of sT. Plain Python."""
        tS, tG = layouts.tma_tiles(atom, sT, gT, rank=rank)
        cute.copy(atom, tG[None, block], tS[None, stage], tma_bar_ptr=bar)

    @cute.jit
    def consume_fp8(self, mdQ, mdK, mdV, sm, pipe_kv, pipe_q, pipe_do, mmas, tidx: Int32,
                    warp_idx: Int32, softmax_scale: Float32, pre_scale: Float32,
                    scale_log2: Float32, window_left: Int32, window_right: Int32,
                    n_block: Int32, kv_head: Int32, batch: Int32, group: Int32, m_min: Int32,
                    num_m: Int32, num_steps: Int32, seqlen_k: Int32, S: Int32, T: Int32,
                    blocks: QueryBlockRange, seg, descales):
        mQD, mdOD = descales[0], descales[1]
        sQ, sQt, sdO, sdOt, sK, sV, sKt, sdS, sLSE, sDelta, sdQ, sAmax, sdS16, sdS_l = sm
        mma_s, mma_dp, mma_dk, mma_dv, mma_dq = mmas
        wg = cute.arch.make_warp_uniform(tidx // 128)
        w_s, w_dp = mma_s.get_slice(wg * 128), mma_dp.get_slice(wg * 128)
        w_dk, w_dv = mma_dk.get_slice(wg * 128), mma_dv.get_slice(wg * 128)
        w_dq = mma_dq.get_slice(wg * 128)
        t_s, t_dk = mma_s.get_slice(tidx), mma_dk.get_slice(tidx)
        t_dv, t_dq = mma_dv.get_slice(tidx), mma_dq.get_slice(tidx)
        tSrK = w_s.make_fragment_A(w_s.partition_A(sK))
        tSrQ = w_s.make_fragment_B(w_s.partition_B(sQ))
        tPrV = w_dp.make_fragment_A(w_dp.partition_A(sV))
        tPrdO = w_dp.make_fragment_B(w_dp.partition_B(sdO))
        tdVrdOt = w_dv.make_fragment_B(w_dv.partition_B(sdOt))
        tdKrQt = w_dk.make_fragment_B(w_dk.partition_B(sQt))
        tdQrdS = w_dq.make_fragment_A(w_dq.partition_A(sdS))
        tdQrKt = w_dq.make_fragment_B(w_dq.partition_B(sKt))
        shape_st = (self.tile_n, self.tile_m)
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = self.tile_accumulators(t_s, t_dk, t_dv, t_dq)
        rP = t_dv.make_fragment_A(t_dv.partition_shape_A(shape_st))
        rdS = t_dk.make_fragment_A(t_dk.partition_shape_A(shape_st))
        coords = TileCoords.make(mma_s, tidx, shape_st)
        tdQsdQ = self.dq_flat_partition(sdQ, tidx)
        key_segs, kd, vd = self.tile_constants(coords, acc_S, seg, descales, batch, kv_head,
                                               n_block)
        # units of the dV / dK accumulators (dO's scale; dS's x q's) of the last step
        unit_v = Float32(1.0)
        unit_k = Float32(1.0)
        lane = cute.arch.lane_idx()
        cw = warp_idx - 4  # consumer warp 0..7

        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)  # K, V, K^T stay until the end: never released
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_stages)
            for step in cutlass.range(num_steps, unroll=1):
                gi = step // num_m
                m_block = m_min + step - gi * num_m
                head = kv_head * group + gi
                stage = state.index
                buf = step % 2
                qd = mQD[batch, head, m_block]
                dod = mdOD[batch, head, m_block]
                amax = self.step_start(
                    (mma_s, mma_dp), (tSrK, tSrQ, tPrV, tPrdO), pipe_q, pipe_do, state,
                    acc_S, acc_dP, acc_dV, unit_v, coords, key_segs, seg, blocks, batch,
                    n_block, m_block, T, seqlen_k, window_left, window_right, sLSE, sDelta,
                    scale_log2, pre_scale, qd, kd, vd, dod)
                unit_v = dod
                # P^T x 2^8 to e4m3 (the A operand's permuted query order), dV += P^T dO.
                # Converted after the branch: before it, the converts were sunk past the
                # wgmma fence into the GEMM (ptxas then injects a warpgroup.arrive, C7519).
                layouts.fp8_operand_a_values(rP).store(
                    layouts.acc_as_fp8_operand_a(acc_S).load().to(self.dtype))
                layouts.wgmma(mma_dv, acc_dV, rP, tdVrdOt[None, None, None, stage],
                              zero_init=False, wait=-1)
                # the block's |dS| max over both warpgroups
                for off in (16, 8, 4, 2, 1):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
                if lane == 0:
                    sAmax[cw, buf] = amax
                cute.arch.barrier(barrier_id=_BAR_AMAX, number_of_threads=self.num_mma_threads)
                amax = sAmax[0, buf]
                for w in cutlass.range_constexpr(1, 8):
                    amax = cute.arch.fmax(amax, sAmax[w, buf])
                ds_scale = Float32(1.0)
                ds_inv = Float32(1.0)
                if amax > Float32(0.0):
                    # the contract's floor: dK's unit ratio stays finite (`AMAX_FLOOR`)
                    amax = cute.arch.fmax(amax, Float32(AMAX_FLOOR))
                    ds_scale = amax / Float32(E4M3_MAX)
                    ds_inv = Float32(E4M3_MAX) / amax
                # dS^T to e4m3 for dK += dS^T Q (units ds_scale x qd)
                layouts.fp8_operand_a_values(rdS).store(
                    (layouts.acc_as_fp8_operand_a(acc_dP).load() * ds_inv).to(self.dtype))
                uk = ds_scale * qd
                rk = unit_k / uk
                for i in cutlass.range_constexpr(cute.size(acc_dK)):
                    acc_dK[i] = acc_dK[i] * rk
                unit_k = uk
                layouts.wgmma(mma_dk, acc_dK, rdS, tdKrQt[None, None, None, stage],
                              zero_init=False, wait=-1)
                self.store_ds(acc_dP, coords, ds_inv, sdS16, sdS_l, buf)
                cute.arch.fence_view_async_shared()  # smem writes -> visible to wgmma
                if warp_idx == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ's last reduce
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=self.num_mma_threads)
                layouts.wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, buf], tdQrKt,
                              zero_init=True, wait=0)
                pipe_q.consumer_release(state)
                pipe_do.consumer_release(state)
                state.advance()
                dq_unit = ds_scale * kd
                for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                    acc_dQ[i] = acc_dQ[i] * dq_unit
                self.flush_dq(mdQ, sdQ, tdQsdQ, None, acc_dQ, m_block, head, batch, n_block,
                              warp_idx, None, blocks)

        if warp_idx == 4:  # the last dQ reduce reads sdQ: shared memory must outlive it
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.store_dkdv_f32(acc_dK, acc_dV, unit_k * softmax_scale,
                            unit_v * Float32(2.0 ** -P_SHIFT_LOG2), mma_dk, mma_dv, tidx, mdK,
                            mdV, kv_head, batch, n_block, S)

    def tile_accumulators(self, t_s, t_dk, t_dv, t_dq):
        """The consumer thread's accumulators of one key block: S^T and dP^T (tile_n x
        tile_m), dK and dV (zeroed: they sum over the steps) and dQ."""
        shape_st = (self.tile_n, self.tile_m)
        acc_S = t_s.make_fragment_C(t_s.partition_shape_C(shape_st))
        acc_dP = t_s.make_fragment_C(t_s.partition_shape_C(shape_st))
        acc_dK = t_dk.make_fragment_C(t_dk.partition_shape_C((self.tile_n, self.hd)))
        acc_dV = t_dv.make_fragment_C(t_dv.partition_shape_C((self.tile_n, self.hdv)))
        acc_dQ = t_dq.make_fragment_C(t_dq.partition_shape_C((self.tile_m, self.hd)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        return acc_S, acc_dP, acc_dK, acc_dV, acc_dQ

    def tile_constants(self, coords: TileCoords, acc_S, seg, descales, batch: Int32,
                       kv_head: Int32, n_block: Int32):
        """What a key block holds for all its steps: the key rows' segment ids (with segment
        ids), K's and V's descales."""
        mKD, mVD = descales[2], descales[3]
        key_segs = None
        if const_expr(self.cfg.has_segments):
            key_segs = SegmentRows.load(
                coords, cute.size(layouts.acc_as_rows_cols(acc_S), mode=[0]),
                n_block * self.tile_n, seg[1][batch, None], seg[1].shape[1],
                seg[2][batch, n_block, 0], seg[2][batch, n_block, 1])
        return key_segs, mKD[batch, kv_head, n_block], mVD[batch, kv_head, n_block]

    @cute.jit
    def step_start(self, mmas, operands, pipe_q, pipe_do, state, acc_S, acc_dP, acc_dV,
                   unit_v: Float32, coords: TileCoords, key_segs, seg, blocks, batch: Int32,
                   n_block: Int32, m_block: Int32, T: Int32, seqlen_k: Int32,
                   window_left: Int32, window_right: Int32, sLSE, sDelta, scale_log2: Float32,
                   pre_scale: Float32, qd: Float32, kd: Float32, vd: Float32,
                   dod: Float32) -> Float32:
        """A step's first half, the same in the 128-key and the head-dim-split kernels: S^T =
        K Q^T and dP^T = V dO^T issued as the query and dO stages land, `step_probs_grads`,
        then dV brought into this step's dO units (it accumulates in the last step's). Returns
        the thread's max |dS|."""
        mma_s, mma_dp = mmas
        tSrK, tSrQ, tPrV, tPrdO = operands
        stage = state.index
        pipe_q.consumer_wait(state)
        layouts.wgmma(mma_s, acc_S, tSrK, tSrQ[None, None, None, stage],
                      zero_init=True, wait=-1)
        pipe_do.consumer_wait(state)
        layouts.wgmma(mma_dp, acc_dP, tPrV, tPrdO[None, None, None, stage],
                      zero_init=True, wait=-1)
        warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
        amax = self.step_probs_grads(
            acc_S, acc_dP, coords, key_segs, seg, blocks, batch, n_block, m_block, T,
            seqlen_k, window_left, window_right, sLSE, sDelta, stage, scale_log2,
            pre_scale, qd, kd, vd * dod)
        if dod != unit_v:
            r = unit_v / dod
            for i in cutlass.range_constexpr(cute.size(acc_dV)):
                acc_dV[i] = acc_dV[i] * r
        return amax

    @cute.jit
    def step_probs_grads(self, acc_S, acc_dP, coords: TileCoords, key_segs, seg, blocks,
                         batch: Int32, n_block: Int32, m_block: Int32, T: Int32,
                         seqlen_k: Int32, window_left: Int32, window_right: Int32, sLSE, sDelta,
                         stage: Int32, scale_log2: Float32, pre_scale: Float32,
                         qd: Float32, kd: Float32, vdo_descale: Float32) -> Float32:
        """One step's S^T (ready) and dP^T (in flight) to P^T and dS^T: the softcap or the
        descales folded into the exp2 scale, the segment and causal / window / length masks,
        the wait for dP^T, then `probs_grads`. Both the 128-key and the head-dim-split
        kernels run it. Returns the thread's max |dS|."""
        sl2 = scale_log2
        if const_expr(self.cfg.has_softcap):
            pre = pre_scale * qd * kd
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * pre, fastmath=True)
        else:
            sl2 = scale_log2 * qd * kd
        if const_expr(self.cfg.has_segments):
            if key_segs.block_needs_compare(seg[3][batch, m_block, 0],
                                            seg[3][batch, m_block, 1]):
                apply_segment_mask(acc_S, coords, key_segs, m_block * self.tile_m,
                                   seg[0][batch, None], T)
        if blocks.needs_mask(n_block, m_block, seqlen_k):
            apply_mask_kq(acc_S, coords, n_block, m_block, self.tile_n, self.tile_m,
                          seqlen_k, window_left, window_right, self.has_right,
                          self.has_left)
        warpgroup.wait_group(0)
        return self.probs_grads(acc_S, acc_dP, coords, sLSE, sDelta, stage, sl2,
                                vdo_descale * Float32(2.0 ** -P_SHIFT_LOG2))

    @cute.jit
    def probs_grads(self, acc_S, acc_dP, coords: TileCoords, sLSE, sDelta, stage: Int32,
                    scale_log2: Float32, dp_scale: Float32) -> Float32:
        """In place: acc_S <- P^T x 2^8 = exp2(S^T scale_log2 - lse2 + 8), acc_dP <- dS^T =
        P^T (dP^T vd dod - delta) (x (1 - t^2) under softcap, acc_S holding t = tanh), in
        true units: the 2^8 of P cancels against delta and dp_scale (which carries 2^-8).
        Returns the thread's max |dS|."""
        s = layouts.acc_as_rows_cols(acc_S)
        dp = layouts.acc_as_rows_cols(acc_dP)
        t0 = coords.t0
        amax = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = coords.base_col + t0[0, j][1]
            lse2 = sLSE[col, stage] - Float32(P_SHIFT_LOG2)
            delta = sDelta[col, stage] * Float32(2.0 ** -P_SHIFT_LOG2)
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                x = s[r, j]
                p = cute.math.exp2(x * scale_log2 - lse2, fastmath=True)
                ds = p * (dp[r, j] * dp_scale - delta)
                if const_expr(self.cfg.has_softcap):
                    t = cute.arch.fmax(x, Float32(-1.0))  # masked: -inf -> factor 0
                    ds = ds * (Float32(1.0) - t * t)
                s[r, j] = p
                dp[r, j] = ds
                amax = cute.arch.fmax(amax, cute.arch.fmax(ds, -ds))
        return amax

    @cute.jit
    def store_ds(self, acc_dS, coords: TileCoords, inv: Float32, sdS16: cute.Tensor,
                 sdS_layout, buf: Int32):
        """dS (x inv, e4m3) into buffer `buf` of the (queries x key positions) tile: a
        thread's keys r and r + 8 of one query are adjacent positions (16w + 2a, +1 for
        key 16w + a, a < 8), one 16-bit store each."""
        d = layouts.acc_as_rows_cols(acc_dS)
        t0 = coords.t0
        key = coords.base_row + t0[0, 0][0]
        pos = key - key % 16 + 2 * (key % 16)
        for j in cutlass.range_constexpr(cute.size(d, mode=[1])):
            q = coords.base_col + t0[0, j][1]
            word = cvt_e4m3x2(d[0, j] * inv, d[1, j] * inv)
            sdS16[cute.crd2idx((q, pos, buf), sdS_layout) >> 1] = word

    @cute.jit
    def store_dkdv_f32(self, acc_dK, acc_dV, k_fac: Float32, v_fac: Float32, mma_dk, mma_dv,
                       tidx: Int32, mdK, mdV, kv_head: Int32, batch: Int32, n_block: Int32,
                       S: Int32):
        """dK x k_fac and dV x v_fac (float32) from registers to global memory, rows past S
        dropped."""
        for acc, mma, m, fac, h in ((acc_dK, mma_dk, mdK, k_fac, self.hd),
                                    (acc_dV, mma_dv, mdV, v_fac, self.hdv)):
            thr = mma.get_slice(tidx)
            gT = cute.local_tile(m[None, None, kv_head, batch], (self.tile_n, h), (n_block, 0))
            tg = thr.partition_C(gT)
            tc = thr.partition_C(cute.make_identity_tensor((self.tile_n, h)))
            row0 = n_block * self.tile_n
            for i in cutlass.range_constexpr(cute.size(acc)):
                if row0 + tc[i][0] < S:
                    tg[i] = acc[i] * fac

