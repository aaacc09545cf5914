"""FlashAttention backward for Blackwell (sm_100a) in the CuTe DSL: `FlashBwdSm100`.

Shape of the kernel (FlashAttention-4's sm100 backward structure, written here from the papers,
NVIDIA's PTX docs and the CuTe DSL's Blackwell helpers):

- One CTA per (key block n of 128 keys, kv head, batch), 512 threads in four warpgroups with
  their own register budgets (`setmaxnreg`, `variants.sm100_bwd.REGS`). The CTA loops over the
  query heads of its GQA group and, for each, over the 128-query blocks that can see the key
  block (`mask.QueryBlockRange`), so dK and dV are summed over the group in tensor memory: no
  atomics for them.
- Load warp (13): K and V once, then per step Q with its lse2 row slice and dO with its delta
  slice (TMA, ``num_stages`` deep).
- MMA warp (12), one thread issues `tcgen05.mma` with every accumulator in tensor memory (the
  keys on the 128 lanes; `tmem_plan.backward_plan`):
    S^T  = K Q^T          (A = K, B = Q: shared memory, K-major)
    dP^T = V dO^T         (A = V, B = dO)
    dV  += P^T dO         (A = P^T from tensor memory, written over S^T; B = dO MN-major)
    dK  += dS^T Q         (A = dS^T from tensor memory, written over dP^T; B = Q MN-major)
    dQ   = dS K           (A = dS from shared memory, B = K MN-major; queries on the lanes)
  Completion is signalled by `tcgen05.commit` onto mbarriers; the Q / dO stages are freed by a
  commit after the step's last MMA.
- Compute warpgroups (warps 4-11; thread t of each owns key row t, warpgroup w the query
  columns [64 w, 64 w + 64)): S^T row slice from tensor memory, softcap / causal / window /
  length masks (`common.mask`, shared with Hopper), P^T = exp2(S^T scale - lse2), written back
  as 16 bits over the S^T columns the warpgroup has read; then dP^T, dS^T = P^T (dP^T - delta)
  (times 1 - tanh^2 under softcap), written as 16 bits over dP^T (for dK) and into shared
  memory (for dQ). At the end: dK (scaled) and dV from tensor memory to global memory.
- dQ reduce warpgroup (warps 0-3; thread t owns query row t): per step, dQ from tensor memory in
  32-column chunks, staged in shared memory and added to the float32 accumulator in global
  memory by TMA reduce-adds (`cp.reduce.async.bulk.tensor ... add.f32`), in key-block order
  under ``deterministic`` (`common.dq_order`).

The host zeroes dQ (and the semaphores) first on the same stream. XLA computes lse2 / delta
before and scales / casts dQ after (`kernels.call`, shared with Hopper).

Head dim 256 runs as two launches of this kernel (``Sm100BwdConfig.bwd_pass``), static
branches of the same roles: "dv" (S^T, P^T, dV += P^T dO: no V, delta, dP^T, dK or dQ; the dQ
reduce warpgroup idles) and "dkdq" (64-query steps: S^T, dP^T, dS^T, dK += dS^T Q and dQ^T =
K^T dS^T, head dims on the lanes in two 128-row halves, reduced by `reduce_dq_t`).

Not done here (yet): 2-CTA MMA, a persistent tile loop. None of this has run on a Blackwell
GPU.
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.tensor_utils
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.dq_order import zero_fill
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.mask import QueryBlockRange
from jaxflash.kernels.sm100.bwd_roles import (DQ_EMPTY, DQ_FULL, DQT_Q, DKV_FULL, DP_FULL, DS_FULL,
                                              LOAD_WARP, MMA_WARP, NUM_MBAR, P_FULL, S_FULL,
                                              BwdRoles, fresh, tmem_fence)
from jaxflash.kernels.variants.bwd import FLOAT_SCALARS, INT_SCALARS
from jaxflash.kernels.variants.sm100_bwd import DQ_CHUNK, REGS, TILE_N, Sm100BwdConfig
from jaxflash.kernels.variants.sm100_bwd_launch import output_names

LOG2_E = math.log2(math.e)
_DQT_ROWS = 128  # head dims per dQ^T MMA (its M) in the "dkdq" pass
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class FlashBwdSm100(BwdRoles):
    """Blackwell backward attention kernel for one `Sm100BwdConfig` variant.

    Host entry (``@cute.jit __call__``), the bridge's order (`variants.sm100_bwd.bwd_launch`):
    q, k, v, do, lse2, delta, [q_seqlen], [kv_seqlen], dq_acc, dk, dv, [dq_sem], fscalars,
    [iscalars], stream.
    """

    def __init__(self, config: Sm100BwdConfig):
        ok, why = config.check()  # includes the tensor-memory plan
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = _DTYPES[config.dtype]
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        plan = config.tmem_plan()
        self.tmem_cols = plan.alloc_cols
        # the pass (hd 256 splits the backward in two: `Sm100BwdConfig.passes`)
        self.tile_m = config.tile_m
        self.has_dv, self.has_dkdq = config.has_dv, config.has_dkdq
        self.dq_t = config.bwd_pass == "dkdq"  # dQ^T = K^T dS^T, head dims on the lanes
        self.s_off = plan.region("S^T").start
        self.dq_over_dp = False
        if self.has_dv:
            self.dv_off = plan.region("dV").start
            self.p_off = tuple(plan.region(f"P^T{w}").start for w in range(2))
        if self.has_dkdq:
            self.dp_off = plan.region("dP^T").start
            self.dk_off = plan.region("dK").start
            self.dq_off = plan.region("dQ").start
            # whether dQ overlays dP^T (then the next dP^T MMA waits for dQ to be read out)
            self.dq_over_dp = plan.region("dQ").overlaps(plan.region("dP^T"))
            self.ds_off = tuple(plan.region(f"dS^T{w}").start for w in range(2))
        self.reduce_regs, self.compute_regs, self.other_regs = REGS
        self.num_threads = 512
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window

    @classmethod
    def can_implement(cls, config: Sm100BwdConfig) -> tuple[bool, str]:
        return config.check()

    def launch_layout(self):
        ins = ["q", "k", "v", "do", "lse2", "delta"]
        ins += mask_inputs(self.cfg, backward=True)
        return (tuple(ins), output_names(self.cfg), FLOAT_SCALARS,
                INT_SCALARS if self.cfg.has_window else ())

    # ------------------------------------------------------------------------------------
    # host
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashBwdSm100({self.cfg.key})")
        mQ, mK, mV, mdO, mLSE, mDelta = a.take(6)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        mAlibi = a.maybe(self.cfg.has_alibi)
        seg = a.maybe(self.cfg.has_segments, 4)  # q ids, kv ids, kv_blocks, q_blocks
        mdQ, mdK = a.maybe(self.has_dkdq, 2)
        mdV = a.maybe(self.has_dv)
        mdAlibi = a.maybe(self.cfg.has_alibi and self.has_dkdq)
        mSem = a.maybe(self.cfg.deterministic and self.has_dkdq)
        mFScalars = a.take()
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch(mQ, mK, mV, mdO, mLSE, mDelta, mQSeqlen, mKVSeqlen, mdQ, mdK, mdV, mSem,
                    mFScalars, mIScalars, stream, (mAlibi, mdAlibi), tuple(seg))

    def tiled_mmas(self):
        """(S^T, dP^T, dV, dK, dQ) tiled MMAs, all 1-CTA, M = 128 (the "dkdq" pass: dQ^T = K^T
        dS^T, M = 128 head dims, N = its queries)."""
        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one = tcgen05.CtaGroup.ONE
        mk = sm100_helpers.make_trivial_tiled_mma
        tmem = tcgen05.OperandSource.TMEM
        m = self.tile_m
        dq_mn = (_DQT_ROWS, m) if self.dq_t else (m, self.hd)
        return (mk(self.dtype, K_, K_, Float32, one, (TILE_N, m)),
                mk(self.dtype, K_, K_, Float32, one, (TILE_N, m)),
                mk(self.dtype, K_, MN, Float32, one, (TILE_N, self.hdv), tmem),
                mk(self.dtype, K_, MN, Float32, one, (TILE_N, self.hd), tmem),
                mk(self.dtype, MN, MN, Float32, one, dq_mn))

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mQSeqlen: Optional[cute.Tensor],
               mKVSeqlen: Optional[cute.Tensor], mdQ: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mSem: Optional[cute.Tensor], mFScalars: cute.Tensor,
               mIScalars: Optional[cute.Tensor], stream: cuda.CUstream, alibi=(None, None),
               segs=(None, None, None, None)):
        for t in (mQ, mK, mV, mdO, mdK, mdV):
            if const_expr(t is not None and t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        for t in (mLSE, mDelta, mdQ):
            if const_expr(t is not None and t.element_type != Float32):
                raise TypeError("lse2, delta and dq_acc must be float32")
        # dQ receives reduce-adds from every key block: zeroed first, on the same stream.
        if const_expr(self.has_dkdq):
            zero_fill(mdQ, stream)
        if const_expr(mSem is not None):
            zero_fill(mSem, stream)
            mSem = layouts.select_modes(mSem, [2, 1, 0])  # (m blocks, N, B)
        if const_expr(alibi[1] is not None):
            zero_fill(alibi[1], stream)  # key blocks no query sees write nothing
        # [B, T, N, H] -> (T, H, N, B): (M or N, K, ...) as the MMA operands' TMA wants.
        mQ, mK, mV, mdO, mdQ, mdK, mdV = [None if t is None else
                                          layouts.select_modes(t, [1, 3, 2, 0])
                                          for t in (mQ, mK, mV, mdO, mdQ, mdK, mdV)]
        mLSE, mDelta = [layouts.select_modes(t, [2, 1, 0]) for t in (mLSE, mDelta)]

        s_mma, dp_mma, dv_mma, dk_mma, dq_mma = self.tiled_mmas()
        m = self.tile_m
        s_tiler = (TILE_N, m, self.hd)
        dp_tiler = (TILE_N, m, self.hdv)
        dv_tiler = (TILE_N, self.hdv, m)
        dk_tiler = (TILE_N, self.hd, m)
        # dQ = dS K (queries x head dims), or per half of the head dims dQ^T = K^T dS^T
        dq_tiler = (_DQT_ROWS, m, TILE_N) if self.dq_t else (m, self.hd, TILE_N)
        st = self.num_stages
        la, lb = sm100_helpers.make_smem_layout_a, sm100_helpers.make_smem_layout_b
        # Each shared tile serves two MMAs under two views of the same bytes: K (A of S^T,
        # K-major) is K^T (B of dQ, MN-major), Q and dO likewise, and dS^T as the compute
        # warps write it (keys x queries, queries contiguous) is dS (A of dQ, MN-major).
        # (dQ^T: K^T is its A, MN-major, one 128-row half of the head dims per MMA, and dS^T
        # its B, MN-major: the same bytes the compute warps write)
        lay = dict(
            sK=la(s_mma, s_tiler, self.dtype, 1),
            sKt=(la if self.dq_t else lb)(dq_mma, dq_tiler, self.dtype, 1),
            sV=la(dp_mma, dp_tiler, self.dtype, 1),
            sQ=lb(s_mma, s_tiler, self.dtype, st), sQt=lb(dk_mma, dk_tiler, self.dtype, st),
            sdO=lb(dp_mma, dp_tiler, self.dtype, st), sdOt=lb(dv_mma, dv_tiler, self.dtype, st),
            tP=la(dv_mma, dv_tiler, self.dtype, 1), tdS=la(dk_mma, dk_tiler, self.dtype, 1),
            sdS=(lb if self.dq_t else la)(dq_mma, dq_tiler, self.dtype, 1),
            sdSw=sm100_helpers.make_smem_layout_epi(
                self.dtype, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, (TILE_N, m), 1),
            sRow=cute.make_layout((m, st), stride=(1, m)),
            sdQ=(layouts.smem_layout(Float32, DQT_Q, DQ_CHUNK, 4) if self.dq_t
                 else layouts.smem_layout(Float32, m, DQ_CHUNK, 2)))

        one = tcgen05.CtaGroup.ONE
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (s_mma.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        sel = lambda l: cute.select(l, mode=[0, 1, 2])
        tma_K, tma_mK = cute.nvgpu.make_tiled_tma_atom_A(g2s, mK, sel(lay["sK"]), s_tiler,
                                                         s_mma, cluster.shape)
        tma_V, tma_mV = None, None
        if const_expr(self.has_dkdq):
            tma_V, tma_mV = cute.nvgpu.make_tiled_tma_atom_A(g2s, mV, sel(lay["sV"]), dp_tiler,
                                                             dp_mma, cluster.shape)
        tma_Q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_B(g2s, mQ, sel(lay["sQ"]), s_tiler,
                                                         s_mma, cluster.shape)
        tma_dO, tma_mdO = cute.nvgpu.make_tiled_tma_atom_B(g2s, mdO, sel(lay["sdO"]), dp_tiler,
                                                           dp_mma, cluster.shape)
        row1 = cute.select(lay["sRow"], mode=[0])
        tma_L, tma_mLSE = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mLSE,
                                                      row1, (m,), 1)
        tma_D, tma_mDelta, tma_dQ, tma_mdQ = None, None, None, None
        if const_expr(self.has_dkdq):
            tma_D, tma_mDelta = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(),
                                                            mDelta, row1, (m,), 1)
            tma_dQ, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ,
                cute.select(lay["sdQ"], mode=[0, 1]), (DQT_Q if self.dq_t else m, DQ_CHUNK))
        self.kv_bytes = cute.size_in_bytes(self.dtype, sel(lay["sK"]))
        self.do_bytes = cute.size_in_bytes(self.dtype, sel(lay["sdO"]))
        if const_expr(self.has_dkdq):  # V, and delta beside dO ("dv" needs neither)
            self.kv_bytes = self.kv_bytes + cute.size_in_bytes(self.dtype, sel(lay["sV"]))
            self.do_bytes = self.do_bytes + m * 4
        self.q_bytes = cute.size_in_bytes(self.dtype, sel(lay["sQ"])) + m * 4

        has_dkdq = self.has_dkdq

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar: cute.struct.MemRange[cutlass.Int64, NUM_MBAR]
            tmem_holding: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, m * st], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, m * st], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sK"])], 1024]
            if const_expr(has_dkdq):  # ("dv": no V, dS or dQ staging; Q and dO get the room)
                sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sV"])],
                                      1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sQ"])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["sdO"])],
                                   1024]
            if const_expr(has_dkdq):
                sdS: cute.struct.Align[cute.struct.MemRange[self.dtype,
                                                            cute.cosize(lay["sdS"])], 1024]
                sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(lay["sdQ"])],
                                       1024]

        S = mK.shape[0]
        num_n_blocks = (S + TILE_N - 1) // TILE_N
        self.kernel(tma_mQ, tma_mK, tma_mV, tma_mdO, tma_mLSE, tma_mDelta, tma_mdQ, mdK, mdV,
                    mQSeqlen, mKVSeqlen, mSem, tma_Q, tma_K, tma_V, tma_dO, tma_L, tma_D,
                    tma_dQ, mFScalars, mIScalars, lay["sK"], lay["sKt"], lay["sV"], lay["sQ"],
                    lay["sQt"], lay["sdO"], lay["sdOt"], lay["tP"], lay["tdS"], lay["sdS"],
                    lay["sdSw"], lay["sRow"], lay["sdQ"], s_mma, dp_mma, dv_mma, dk_mma,
                    dq_mma, alibi, segs, SharedStorage).launch(
            grid=[num_n_blocks, mK.shape[2], mK.shape[3]], block=[self.num_threads, 1, 1],
            stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------
    # device
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mQSeqlen: Optional[cute.Tensor],
               mKVSeqlen: Optional[cute.Tensor], mSem: Optional[cute.Tensor],
               tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
               tma_dO: cute.CopyAtom, tma_L: cute.CopyAtom, tma_D: cute.CopyAtom,
               tma_dQ: cute.CopyAtom, mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor],
               sK_l: cute.ComposedLayout, sKt_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               sQ_l: cute.ComposedLayout, sQt_l: cute.ComposedLayout,
               sdO_l: cute.ComposedLayout, sdOt_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout, tdS_l: cute.ComposedLayout,
               sdS_l: cute.ComposedLayout, sdSw_l: cute.ComposedLayout, sRow_l: cute.Layout,
               sdQ_l: cute.ComposedLayout, s_mma: cute.TiledMma, dp_mma: cute.TiledMma,
               dv_mma: cute.TiledMma, dk_mma: cute.TiledMma, dq_mma: cute.TiledMma, alibi,
               segs, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V, tma_dO, tma_L, tma_D):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        if const_expr(self.has_dkdq):
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_dQ)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i, count in ((S_FULL, 1), (DP_FULL, 1), (P_FULL, 256), (DS_FULL, 256),
                                 (DQ_FULL, 1), (DQ_EMPTY, 128), (DKV_FULL, 1)):
                    cute.arch.mbarrier_init(mbar + i, count)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipes = {}
        for name, stages, nbytes, store in (("kv", 1, self.kv_bytes, storage.mbar_kv),
                                            ("q", self.num_stages, self.q_bytes, storage.mbar_q),
                                            ("do", self.num_stages, self.do_bytes,
                                             storage.mbar_do)):
            pipes[name] = pipeline.PipelineTmaUmma.create(
                num_stages=stages, producer_group=one_thread, consumer_group=one_thread,
                tx_count=nbytes, barrier_storage=store.data_ptr(), defer_sync=True)
        cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(None, is_relaxed=False)

        view = lambda st, l: st.get_tensor(l.outer, swizzle=l.inner)
        alias = lambda t, l: cute.make_tensor(cute.recast_ptr(t.iterator, l.inner), l.outer)
        # (the hd 64 / 128 kernel creates these views in this order; the passes skip some)
        dkdq = self.has_dkdq
        sK = view(storage.sK, sK_l)
        sV = view(storage.sV, sV_l) if dkdq else None
        sQ = view(storage.sQ, sQ_l)
        sdO = view(storage.sdO, sdO_l)
        sdS = view(storage.sdS, sdS_l) if dkdq else None
        if const_expr(self.dq_t):
            # K^T per 128-row half of the head dims: the half's K columns start 128 x 128
            # elements further (K-major K tiles the keys first: checked in
            # `test_sm100_bwd_compile.py::test_hd256_operand_views`)
            sKt = [cute.make_tensor(cute.recast_ptr(sK.iterator + h * _DQT_ROWS * TILE_N,
                                                    sKt_l.inner), sKt_l.outer)
                   for h in range(self.hd // _DQT_ROWS)]
        else:
            sKt = alias(sK, sKt_l) if dkdq else None
        smem_t = dict(sK=sK, sKt=sKt, sV=sV, sQ=sQ, sQt=alias(sQ, sQt_l) if dkdq else None,
                      sdO=sdO, sdOt=alias(sdO, sdOt_l), sdS=sdS,
                      sdSw=alias(sdS, sdSw_l) if dkdq else None,
                      sLSE=storage.sLSE.get_tensor(sRow_l),
                      sDelta=storage.sDelta.get_tensor(sRow_l) if dkdq else None,
                      sdQ=view(storage.sdQ, sdQ_l) if dkdq else None)

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

        # Tensor memory: the MMA warp allocates the plan's columns for the whole CTA.
        if warp_idx == MMA_WARP:
            cute.arch.alloc_tmem(self.tmem_cols, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        pipeline.pipeline_init_wait()
        cute.arch.barrier()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, alignment=16,
                                           ptr_to_buffer_holding_addr=storage.tmem_holding.ptr)
        tm = self.tmem_tensors(tmem, s_mma, dp_mma, dv_mma, dk_mma, dq_mma)

        # Each role derives the CTA's walk itself (cheap integer math): values computed before
        # the split and live across the setmaxnreg were spilled by ptxas.
        rng = (mQ, mK, mQSeqlen, mKVSeqlen, segs[2], window_left, window_right)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.reduce_regs)
            if const_expr(self.has_dkdq):  # (idle in the "dv" pass: no dQ)
                blocks, walk, seqlen_k = self.walk(*rng)
                if const_expr(self.dq_t):
                    self.reduce_dq_t(tidx, tm, mbar, smem_t["sdQ"], mdQ, tma_dQ, mSem, blocks,
                                     walk)
                else:
                    self.reduce_dq(tidx, tm, mbar, smem_t["sdQ"], mdQ, tma_dQ, mSem, blocks,
                                   walk)
        elif warp_idx < 12:
            cute.arch.setmaxregister_increase(self.compute_regs)
            blocks, walk, seqlen_k = self.walk(*rng)
            self.compute(tidx - 128, tm, mbar, smem_t, pipes, mdK, mdV, blocks, walk,
                         seqlen_k, softmax_scale, scale_log2, pre_scale, window_left,
                         window_right, alibi, segs, mQ.shape[0])
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            blocks, walk, seqlen_k = self.walk(*rng)
            if warp_idx == MMA_WARP:
                self.mma(tm, smem_t, tP_l, tdS_l, mbar, pipes, s_mma, dp_mma, dv_mma, dk_mma,
                         dq_mma, walk)
            elif warp_idx == LOAD_WARP:
                self.load(mQ, mK, mV, mdO, mLSE, mDelta, smem_t, tma_Q, tma_K, tma_V, tma_dO,
                          tma_L, tma_D, s_mma, dp_mma, pipes, walk)
        tmem_fence(after=False)
        cute.arch.barrier()
        if warp_idx == MMA_WARP:
            tmem_fence(after=True)
            cute.arch.dealloc_tmem(tmem, self.tmem_cols)

    @cute.jit
    def walk(self, mQ, mK, mQSeqlen, mKVSeqlen, mKVBlk, window_left: Int32,
             window_right: Int32):
        """(block range, walk, seqlen_k) of this CTA: walk = (n_block, kv_head, batch, group,
        m_min, num_m, num_steps), the steps being the query blocks [m_min, m_min + num_m) of
        each of the group's query heads in turn."""
        n_block, kv_head, batch = cute.arch.block_idx()
        T = mQ.shape[0]
        S = mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        seqlen_q = T
        if const_expr(mQSeqlen is not None):
            seqlen_q = cutlass.max(cutlass.min(T, mQSeqlen[batch]), 0)
        seqlen_k = S
        if const_expr(mKVSeqlen is not None):
            seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
        blocks = QueryBlockRange(self.tile_m, TILE_N, self.has_right, self.has_left, window_left,
                                 window_right)
        m_min, m_max = blocks.m_block_min_max(n_block, seqlen_q, seqlen_k)
        if const_expr(mKVBlk is not None):
            # segment block skipping: only query blocks whose ids can meet this key block's
            # (exact for sorted, document-packed ids; `common.segments`)
            m_min = cutlass.max(m_min, mKVBlk[batch, n_block, 2])
            m_max = cutlass.max(cutlass.min(m_max, mKVBlk[batch, n_block, 3]), m_min)
        num_m = m_max - m_min
        return blocks, (n_block, kv_head, batch, group, m_min, num_m, group * num_m), seqlen_k

    def tmem_tensors(self, tmem, s_mma, dp_mma, dv_mma, dk_mma, dq_mma):
        """The accumulators' tensor-memory views (plain Python, inlined while tracing)."""
        def acc(mma, shape, off):
            thr = mma.get_slice(0)
            frag = thr.make_fragment_C(thr.partition_shape_C(shape))
            return cute.make_tensor(tmem + off, frag.layout)
        m = self.tile_m
        tm = dict(S=acc(s_mma, (TILE_N, m), self.s_off))
        if const_expr(self.has_dkdq):
            tm["dP"] = acc(dp_mma, (TILE_N, m), self.dp_off)
        if const_expr(self.has_dv):
            tm["dV"] = acc(dv_mma, (TILE_N, self.hdv), self.dv_off)
        if const_expr(self.has_dkdq):
            tm["dK"] = acc(dk_mma, (TILE_N, self.hd), self.dk_off)
            # dQ^T: the first 128-head-dim half; half h is m columns further
            tm["dQ"] = acc(dq_mma, (_DQT_ROWS, m) if self.dq_t else (m, self.hd), self.dq_off)
        return tm

    # ---------------------------------------------------------------- load warp
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE, mDelta, smem_t, tma_Q, tma_K, tma_V, tma_dO, tma_L,
             tma_D, s_mma, dp_mma, pipes, walk):
        n_block, kv_head, batch, group, m_min, num_m, num_steps = walk
        s_thr = s_mma.get_slice(0)
        dp_thr = dp_mma.get_slice(0)
        gK = cute.flat_divide(mK[None, None, kv_head, batch], (TILE_N, self.hd))
        if const_expr(self.has_dkdq):
            gV = cute.flat_divide(mV[None, None, kv_head, batch], (TILE_N, self.hdv))
        tKsK, tKgK = self.tma_views(tma_K, smem_t["sK"], s_thr.partition_A(gK))
        if const_expr(self.has_dkdq):
            tVsV, tVgV = self.tma_views(tma_V, smem_t["sV"], dp_thr.partition_A(gV))
        pkv, pq, pdo = pipes["kv"], pipes["q"], pipes["do"]
        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pkv.producer_acquire(kv_state)
            bar = pkv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKgK[None, n_block, 0], tKsK[None, 0], tma_bar_ptr=bar)
            if const_expr(self.has_dkdq):
                cute.copy(tma_V, tVgV[None, n_block, 0], tVsV[None, 0], tma_bar_ptr=bar)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.num_stages)
            for step in cutlass.range(num_steps, unroll=1):
                g = step // num_m
                m_block = m_min + step - g * num_m
                head = kv_head * group + g
                gQ = cute.flat_divide(mQ[None, None, head, batch], (self.tile_m, self.hd))
                gdO = cute.flat_divide(mdO[None, None, head, batch], (self.tile_m, self.hdv))
                tQsQ, tQgQ = self.tma_views(tma_Q, smem_t["sQ"], s_thr.partition_B(gQ))
                tOsO, tOgO = self.tma_views(tma_dO, smem_t["sdO"], dp_thr.partition_B(gdO))
                gL = cute.local_tile(mLSE[None, head, batch], (self.tile_m,), (None,))
                if const_expr(self.has_dkdq):
                    gD = cute.local_tile(mDelta[None, head, batch], (self.tile_m,), (None,))
                tLsL, tLgL = layouts.tma_tiles(tma_L, smem_t["sLSE"], gL, rank=1)
                if const_expr(self.has_dkdq):
                    tDsD, tDgD = layouts.tma_tiles(tma_D, smem_t["sDelta"], gD, rank=1)
                pq.producer_acquire(state)
                bar = pq.producer_get_barrier(state)
                cute.copy(tma_Q, tQgQ[None, m_block, 0], tQsQ[None, state.index],
                          tma_bar_ptr=bar)
                cute.copy(tma_L, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=bar)
                pdo.producer_acquire(state)
                bar = pdo.producer_get_barrier(state)
                cute.copy(tma_dO, tOgO[None, m_block, 0], tOsO[None, state.index],
                          tma_bar_ptr=bar)
                if const_expr(self.has_dkdq):
                    cute.copy(tma_D, tDgD[None, m_block], tDsD[None, state.index],
                              tma_bar_ptr=bar)
                state.advance()

    @staticmethod
    def tma_views(atom, s, g):
        """(smem, gmem) views of a TMA copy of one MMA operand tile (no multicast)."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                     cute.group_modes(g, 0, 3))

    # ---------------------------------------------------------------- MMA warp
    @cute.jit
    def mma(self, tm, smem_t, tP_l, tdS_l, mbar, pipes, s_mma, dp_mma, dv_mma, dk_mma, dq_mma,
            walk):
        num_steps = walk[6]
        s_thr, dp_thr = s_mma.get_slice(0), dp_mma.get_slice(0)
        dv_thr, dk_thr, dq_thr = dv_mma.get_slice(0), dk_mma.get_slice(0), dq_mma.get_slice(0)
        tSrK = s_thr.make_fragment_A(smem_t["sK"])
        tSrQ = s_thr.make_fragment_B(smem_t["sQ"])
        dkdq = self.has_dkdq
        tPrV = dp_thr.make_fragment_A(smem_t["sV"]) if dkdq else None
        tPrdO = dp_thr.make_fragment_B(smem_t["sdO"]) if dkdq else None
        tVrdO = dv_thr.make_fragment_B(smem_t["sdOt"]) if self.has_dv else None
        tKrQ = dk_thr.make_fragment_B(smem_t["sQt"]) if dkdq else None
        if const_expr(self.dq_t):  # dQ^T = K^T dS^T: K^T is A (per head-dim half), dS^T is B
            tQrdS = dq_thr.make_fragment_B(smem_t["sdS"])
            tQrK = [dq_thr.make_fragment_A(t) for t in smem_t["sKt"]]
        else:
            tQrdS = dq_thr.make_fragment_A(smem_t["sdS"]) if dkdq else None
            tQrK = dq_thr.make_fragment_B(smem_t["sKt"]) if dkdq else None
        pkv, pq, pdo = pipes["kv"], pipes["q"], pipes["do"]
        if num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pkv.consumer_wait(kv_state)  # K and V stay until the end: never released
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.num_stages)
            for i in cutlass.range(num_steps, unroll=1):
                stage = state.index
                pq.consumer_wait(state)
                self.gemm(s_mma, tm["S"], tSrK[None, None, None, 0],
                          tSrQ[None, None, None, stage], Int32(0))
                with cute.arch.elect_one():
                    tcgen05.commit(mbar + S_FULL)
                pdo.consumer_wait(state)
                if const_expr(dkdq):
                    if const_expr(self.dq_over_dp):
                        # dP^T's columns hold the last step's dQ until the reduce warps read it
                        if i > 0:
                            cute.arch.mbarrier_wait(mbar + DQ_EMPTY, (i - 1) % 2)
                    self.gemm(dp_mma, tm["dP"], tPrV[None, None, None, 0],
                              tPrdO[None, None, None, stage], Int32(0))
                    with cute.arch.elect_one():
                        tcgen05.commit(mbar + DP_FULL)
                if const_expr(self.has_dv):
                    # dV += P^T dO once the compute warps wrote P^T over S^T
                    cute.arch.mbarrier_wait(mbar + P_FULL, i % 2)
                    tmem_fence(after=True)
                    self.gemm_tmem_a(dv_mma, tm["dV"], tm["S"].iterator, tP_l,
                                     tVrdO[None, None, None, stage], self.p_off, self.s_off, i)
                if const_expr(dkdq):
                    # dK += dS^T Q, dQ = dS K once dS^T is in tensor and shared memory (in
                    # "dkdq" S^T is free once dS^T is: the compute warps read it first)
                    cute.arch.mbarrier_wait(mbar + DS_FULL, i % 2)
                    tmem_fence(after=True)
                    self.gemm_tmem_a(dk_mma, tm["dK"], tm["dP"].iterator, tdS_l,
                                     tKrQ[None, None, None, stage], self.ds_off, self.dp_off, i)
                    if const_expr(not self.dq_over_dp):
                        if i > 0:
                            cute.arch.mbarrier_wait(mbar + DQ_EMPTY, (i - 1) % 2)
                    if const_expr(self.dq_t):
                        for h in cutlass.range_constexpr(len(tQrK)):
                            acc = cute.make_tensor(tm["dQ"].iterator + h * self.tile_m,
                                                   tm["dQ"].layout)
                            self.gemm(dq_mma, acc, tQrK[h][None, None, None, 0],
                                      tQrdS[None, None, None, 0], Int32(0))
                    else:
                        self.gemm(dq_mma, tm["dQ"], tQrdS[None, None, None, 0],
                                  tQrK[None, None, None, 0], Int32(0))
                    with cute.arch.elect_one():
                        tcgen05.commit(mbar + DQ_FULL)
                pq.consumer_release(state)
                pdo.consumer_release(state)
                state.advance()
            with cute.arch.elect_one():
                tcgen05.commit(mbar + DKV_FULL)

    @cute.jit
    def gemm(self, tiled_mma, acc, a, b, accumulate: Int32):
        """acc (+)= a b over the k-blocks (``accumulate`` != 0: add to acc from the start)."""
        # A rolled loop over the k-blocks: unrolled, ptxas hoists every k-block's two 64-bit
        # descriptors of every GEMM out of the step loop (all loop-invariant at one stage) and
        # the MMA warp spills them; rolled, only the bases stay live.
        mma = fresh(tiled_mma)
        for k in cutlass.range(cute.size(a, mode=[2]), unroll=1):
            mma.set(tcgen05.Field.ACCUMULATE, (accumulate != 0) | (k > 0))
            cute.gemm(mma, acc, a[None, None, k], b[None, None, k], acc)

    @cute.jit
    def gemm_tmem_a(self, tiled_mma, acc, host_ptr, a_l, b, parts, host: int, i: Int32):
        """acc (+)= A b with A (P^T or dS^T, 16-bit, two per column) in tensor memory over the
        buffer at ``host_ptr`` (float32 TMEM pointer), accumulating after step 0. A lies in two
        parts, compute warpgroup w's queries at columns ``parts[w]``
        (`tmem_plan.backward_plan`): k-block k (16 queries, 8 columns) of warpgroup k // kw
        is at parts[k // kw] + 8 (k % kw)."""
        # make_fragment_A of a TMEM operand gives the fragment's layout on a fresh, zero-based
        # TMEM pointer: the allocated address is put back explicitly.
        thr = tiled_mma.get_slice(0)
        frag = thr.make_fragment_A(cute.make_tensor(cute.recast_ptr(host_ptr, dtype=self.dtype),
                                                    a_l.outer))[None, None, 0, 0]
        kb = cute.size(b, mode=[2])
        kw = kb // 2
        mma = fresh(tiled_mma)
        for k in cutlass.range_constexpr(kb):
            col = parts[k // kw] - host + 8 * (k % kw)
            a = cute.make_tensor(cute.recast_ptr(host_ptr + col, dtype=self.dtype), frag.layout)
            mma.set(tcgen05.Field.ACCUMULATE, (i > 0) | (k > 0))
            cute.gemm(mma, acc, a, b[None, None, k], acc)
