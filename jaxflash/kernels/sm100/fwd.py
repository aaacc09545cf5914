"""FlashAttention forward for Blackwell (sm_100a) in the CuTe DSL: `FlashFwdSm100`.

Shape of the kernel (FlashAttention-4's structure, written here from the paper, NVIDIA's PTX docs
and the CuTe DSL's Blackwell helpers):

- One CTA computes 128 query rows of one (batch, head), 384 threads in three warpgroups with
  their own register budgets (`setmaxnreg`, `variants.sm100_fwd.REGS`):
  warpgroup 0 = softmax (thread t owns row t), warpgroup 1 = correction and epilogue (thread t
  again owns row t), warpgroup 2 = the MMA warp (8) and the TMA load warp (9).
- Load warp: Q once, then K and V of each key block into two TMA rings (key blocks right to left,
  so the masked ones come first).
- MMA warp (one thread issues): S_j = Q K_j^T by `tcgen05.mma` into tensor memory, alternating
  two S buffers, so QK of block j + 1 runs while the softmax reads block j; O += P_j V_j with P
  read from tensor memory (A operand in TMEM), accumulating in TMEM. Completion is signalled by
  `tcgen05.commit` onto mbarriers.
- Softmax: S row from TMEM (`tcgen05.ld`), logit transforms and masks (`common.mask`, shared
  with Hopper), the row max with conditional rescaling (the reference max moves only when the
  block's max exceeds it by more than ``rescale_threshold``), exp2 partly on MUFU and partly by
  a polynomial on the FMA pipes (`sm100.exp2`), P rounded to 16 bits and written back over the
  S columns it has already read (`tcgen05.st`; the plan is checked in `variants.tmem_plan`).
- Correction: per block, the row's rescale factor from shared memory; if any row of the warp
  moved its reference, O's row is loaded, scaled and stored back in TMEM between PV_{j-1} and
  PV_j. Epilogue: O / rowsum converted and stored straight from registers, LSE per row.

Not done here (yet): 2-CTA MMA (`cta_group::2`), a persistent tile loop, two Q tiles per CTA
(FA4's softmax ping-pong), TMA stores of O. None of this has run on a Blackwell GPU.
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import cpasync, tcgen05

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.carry import Carried
from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.common.mask import (BlockRange, SegmentRows, TileCoords, apply_alibi,
                                          apply_mask)
from jaxflash.kernels.common.scheduler import TileScheduler
from jaxflash.kernels.sm100.exp2 import exp2_poly_pair
from jaxflash.kernels.sm100.fwd_tile import segment_mask, tile_range
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS, L2_SECTION_MB
from jaxflash.kernels.variants.sm100_fwd import REGS, TILE_M, Sm100FwdConfig

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}

_MMA_WARP = 8
_LOAD_WARP = 9
# mbarriers of the kernel's own handshakes (index into `SharedStorage.mbar`)
_S_FULL = 0    # [2] S_j in TMEM (tcgen05.commit, 1 arrival)
_P_FULL = 2    # [2] P_j in TMEM (128 softmax threads)
_STATS = 4     # [2] row rescale factor of block j in shared memory (128 softmax threads)
_O_READY = 6   # O rescaled for block j (128 correction threads)
_O_DONE = 7    # PV_j complete (tcgen05.commit)
_FINAL = 8     # row sum / reference max of the tile in shared memory (128 softmax threads)
_NUM_MBAR = 9
# named barrier of the 128 softmax threads (0 is the CTA's): a key block's segment ids staged
_BAR_SEG = 1


@dsl_user_op
def _tmem_fence(after: bool, *, loc=None, ip=None):
    """tcgen05.fence::after_thread_sync (after an mbarrier wait, before tcgen05 work that
    depends on what the arriving threads did) or ::before_thread_sync (after tcgen05 work,
    before the arrive that publishes it): orders the asynchronous tensor-memory operations
    with the thread synchronization."""
    kind = (nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after
            else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)
    nvvm.tcgen05_fence(kind, loc=loc, ip=ip)


def _fresh(tiled_mma):
    """A new tiled MMA of the same op: the accumulate flag is IR state of the object, so a
    flag set inside a loop or branch must not be read outside it; each issue site sets its own."""
    return cute.make_tiled_mma(cute.make_mma_atom(tiled_mma.op))


class _Mods(Carried):
    """Per-tile score-transform inputs (``alibi`` slope, segment ``rows`` / ``kv_seg`` /
    ``kv_blk`` / ``S``); only the present ones are in ``_dynamic``."""


class FlashFwdSm100:
    """Blackwell forward attention kernel for one `Sm100FwdConfig` variant.

    Host entry (``@cute.jit __call__``): the bridge's argument order and tensor layouts, the
    same as `FlashFwdSm90`'s (q, k, v, [q_seqlen], [kv_seqlen], [alibi], [segments x 4], o,
    lse, float scalars, [int scalars], stream).

    Hooks for the FP8 subclass (`sm100.fwd_fp8`), compile-time no-ops here: ``DTYPES`` (the
    operand types; P is stored in the operand type), ``o_dtype``, ``p_shift_log2`` (P scaled by
    a power of two before its conversion), the optional descale tensors mQD / mKD / mVD, and
    `fold_descales`, `block_scores`, `o_rescale`, `output_descale`.
    """

    DTYPES = _DTYPES

    def __init__(self, config: Sm100FwdConfig):
        ok, why = config.check()  # includes the tensor-memory plan
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.dtype = self.DTYPES[config.dtype]
        self.o_dtype = self.dtype
        self.p_shift_log2 = 0
        self.tile_n = config.tile_n
        self.hd, self.hdv = config.head_dim, config.head_dim_v
        self.num_stages = config.num_stages
        plan = config.tmem_plan()
        self.s_off = (plan.region("S0").start, plan.region("S1").start)
        self.p_off = (plan.region("P0").start, plan.region("P1").start)
        self.o_off = plan.region("O").start
        self.tmem_cols = plan.alloc_cols
        self.softmax_regs, self.correction_regs, self.other_regs = REGS
        self.num_threads = 384
        self.has_right = config.is_causal or config.has_window
        self.has_left = config.has_window

    @classmethod
    def can_implement(cls, config: Sm100FwdConfig) -> tuple[bool, str]:
        return config.check()

    # -------------------------------------------------------------- hooks (FP8 subclass)
    def fold_descales(self, mQD, mKD, m_block, head, kv_head, batch, scale_log2, pre_scale):
        """(scale_log2, pre_scale) with the operands' dequantization scales folded in."""
        return scale_log2, pre_scale

    def output_descale(self, mVD, kv_head, batch, n_min):
        """A factor on 1 / rowsum in the epilogue, or None."""
        return None

    def descale_mods(self, mods, desc) -> list:
        """Per-tile scale inputs the softmax reads (names of the `_Mods` fields set)."""
        return []

    def block_scores(self, rS, mods, n_block):
        """Transform the raw scores of key block `n_block` before softcap and masks."""

    def o_rescale(self, acc_scale, mods, n_block):
        """The factor the correction warpgroup applies to O before PV of `n_block`."""
        return acc_scale

    # ------------------------------------------------------- hooks (2-CTA subclass)
    def commit(self, mbar_ptr):
        """tcgen05.commit of the MMAs issued so far onto `mbar_ptr` (one elected thread)."""
        tcgen05.commit(mbar_ptr)

    def arrive_mma(self, mbar_ptr):
        """Arrive on a barrier the MMA warp waits on (P written, O rescaled)."""
        cute.arch.mbarrier_arrive(mbar_ptr)

    def launch_layout(self):
        ins = ["q", "k", "v"]
        ins += mask_inputs(self.cfg)
        return tuple(ins), ("o", "lse"), FLOAT_SCALARS, INT_SCALARS if self.cfg.has_window else ()

    # ------------------------------------------------------------------------------------
    # host
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashFwdSm100({self.cfg.key})")
        mQ, mK, mV = a.take(3)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        mAlibi = a.maybe(self.cfg.has_alibi)
        seg = a.maybe(self.cfg.has_segments, 4)
        mO, mLSE, mFScalars = a.take(3)
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        self.launch(mQ, mK, mV, mQSeqlen, mKVSeqlen, mAlibi, seg[0], seg[1], seg[2], seg[3], mO,
                    mLSE, mFScalars, mIScalars, stream, None, None, None)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
               mAlibi: Optional[cute.Tensor], mQSeg: Optional[cute.Tensor],
               mKVSeg: Optional[cute.Tensor], mQBlk: Optional[cute.Tensor],
               mKVBlk: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor], stream: cuda.CUstream,
               mQD: Optional[cute.Tensor], mKD: Optional[cute.Tensor],
               mVD: Optional[cute.Tensor]):
        for t, dt in ((mQ, self.dtype), (mK, self.dtype), (mV, self.dtype), (mO, self.o_dtype)):
            if const_expr(t.element_type != dt):
                raise TypeError(f"expected {dt}, got {t.element_type}")
        # [B, T, N, H] -> (T, H, N, B): (M or N, K, ...) as the MMA operands' TMA wants;
        # V as (Hv, S, K, B): the PV MMA's B operand is (N = Hv, K = keys), Hv contiguous.
        mQ, mK, mO = [layouts.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mV = layouts.select_modes(mV, [3, 1, 2, 0])
        mLSE = layouts.select_modes(mLSE, [2, 1, 0])  # (T, N, B)

        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one = tcgen05.CtaGroup.ONE
        qk_tiler = (TILE_M, self.tile_n, self.hd)
        pv_tiler = (TILE_M, self.hdv, self.tile_n)
        qk_mma = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, K_, Float32, one,
                                                      qk_tiler[:2])
        pv_mma = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, MN, Float32, one,
                                                      pv_tiler[:2], tcgen05.OperandSource.TMEM)
        sQ_l = sm100_helpers.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, 1)
        sK_l = sm100_helpers.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.num_stages)
        sV_l = sm100_helpers.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.num_stages)
        tP_l = sm100_helpers.make_smem_layout_a(pv_mma, pv_tiler, self.dtype, 1)

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        one_q = cute.select(sQ_l, mode=[0, 1, 2])
        one_k = cute.select(sK_l, mode=[0, 1, 2])
        one_v = cute.select(sV_l, mode=[0, 1, 2])
        tma_Q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, one_q, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_K, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, one_k, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_V, tma_mV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mV, one_v, pv_tiler, pv_mma,
                                                         cluster.shape)
        self.q_bytes = cute.size_in_bytes(self.dtype, one_q)
        self.k_bytes = cute.size_in_bytes(self.dtype, one_k)
        self.v_bytes = cute.size_in_bytes(self.dtype, one_v)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar: cute.struct.MemRange[cutlass.Int64, _NUM_MBAR]
            tmem_holding: Int32
            # per row: rescale factor of blocks j % 2; final (row sum, reference max)
            row_scale: cute.struct.MemRange[Float32, 2 * TILE_M]
            row_final: cute.struct.MemRange[Float32, 2 * TILE_M]
            # the key blocks' segment ids, blocks j % 2 (`segment_mask`)
            kv_seg: cute.struct.MemRange[Int32, 2 * self.tile_n if self.cfg.has_segments else 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_l)], 1024]

        T = mQ.shape[0]
        num_m_blocks = (T + TILE_M - 1) // TILE_M
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        scheduler = TileScheduler(lpt=self.has_right, section_bytes=L2_SECTION_MB * 1024 * 1024)
        self.kernel(tma_mQ, tma_mK, tma_mV, mO, mLSE, mQSeqlen, mKVSeqlen, mAlibi, mQSeg,
                    mKVSeg, mQBlk, mKVBlk, tma_Q, tma_K, tma_V, mFScalars, mIScalars, sQ_l,
                    sK_l, sV_l, tP_l, qk_mma, pv_mma, scheduler, num_m_blocks, mQD, mKD, mVD,
                    SharedStorage).launch(grid=[num_tiles, 1, 1], block=[self.num_threads, 1, 1],
                                          stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------
    # device
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mQSeqlen: Optional[cute.Tensor],
               mKVSeqlen: Optional[cute.Tensor], mAlibi: Optional[cute.Tensor],
               mQSeg: Optional[cute.Tensor], mKVSeg: Optional[cute.Tensor],
               mQBlk: Optional[cute.Tensor], mKVBlk: Optional[cute.Tensor],
               tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
               mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor],
               sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
               scheduler: cutlass.Constexpr, num_m_blocks: Int32,
               mQD: Optional[cute.Tensor], mKD: Optional[cute.Tensor],
               mVD: Optional[cute.Tensor], SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == _LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i, count in ((_S_FULL, 1), (_S_FULL + 1, 1), (_P_FULL, 128),
                                 (_P_FULL + 1, 128), (_STATS, 128), (_STATS + 1, 128),
                                 (_O_READY, 128), (_O_DONE, 1), (_FINAL, 128)):
                    cute.arch.mbarrier_init(mbar + i, count)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipes = {}
        for name, stages, nbytes, store in (("q", 1, self.q_bytes, storage.mbar_q),
                                            ("k", self.num_stages, self.k_bytes, storage.mbar_k),
                                            ("v", self.num_stages, self.v_bytes, storage.mbar_v)):
            pipes[name] = pipeline.PipelineTmaUmma.create(
                num_stages=stages, producer_group=one_thread, consumer_group=one_thread,
                tx_count=nbytes, barrier_storage=store.data_ptr(), defer_sync=True)
        cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(None, is_relaxed=False)

        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        sScale = storage.row_scale.get_tensor(cute.make_layout((TILE_M, 2)))
        sFinal = storage.row_final.get_tensor(cute.make_layout((TILE_M, 2)))
        sSeg = None
        if const_expr(self.cfg.has_segments):
            sSeg = storage.kv_seg.get_tensor(cute.make_layout((self.tile_n, 2)))

        # Tensor memory: the MMA warp allocates the plan's columns for the whole CTA.
        if warp_idx == _MMA_WARP:
            cute.arch.alloc_tmem(self.tmem_cols, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        pipeline.pipeline_init_wait()
        cute.arch.barrier()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, alignment=16,
                                           ptr_to_buffer_holding_addr=storage.tmem_holding.ptr)
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tStS = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_M, self.tile_n)))
        tStS = cute.make_tensor(tmem + self.s_off[0], tStS.layout)
        tOtO = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_M, self.hdv)))
        tOtO = cute.make_tensor(tmem + self.o_off, tOtO.layout)

        # Only the tile's coordinates (3 registers) cross the warp-role split; its lengths,
        # window, key-block range and scalars are computed inside each role, after its
        # `setmaxnreg`: computed before the split they stayed live into the 104-register MMA /
        # load warps, and with windows, lengths or segment ids ptxas spilled. (The coordinates
        # are decoded once: the LPT order's divisions would be repeated in every role.)
        bid, _, _ = cute.arch.block_idx()
        kv_bytes = mK.shape[0] * (self.hd + self.hdv) * (self.dtype.width // 8)
        m_block, head, batch = scheduler.decode(bid, num_m_blocks, mQ.shape[2], mQ.shape[3],
                                                kv_bytes)
        tile = (self.cfg, TILE_M, m_block, head, batch, mQ, mK, mQSeqlen, mKVSeqlen, mQBlk,
                mIScalars)
        if warp_idx < 4:
            cute.arch.setmaxregister_increase(self.softmax_regs)
            t = tile_range(*tile)
            # (descales are read per role too: live across the split they spilled)
            scale_log2, pre_scale = self.fold_descales(mQD, mKD, t.m_block, t.head, t.kv_head,
                                                       t.batch, *self.scales(mFScalars, True))
            alibi_unit = mFScalars[1 if self.cfg.has_softcap else 0]  # ALiBi's slope unit
            segs = (mQ, mK, mAlibi, mQSeg, mKVSeg, mQBlk, mKVBlk, alibi_unit, t.head, t.batch,
                    (mKD, mVD, t.kv_head, t.batch), sSeg)
            self.softmax(tidx, qk_thr, tStS, mbar, sScale, sFinal, t.blocks, segs, t.m_block,
                         t.n_min, t.n_max, t.count, t.seqlen_k, scale_log2, pre_scale,
                         t.blocks.window_left, t.blocks.window_right)
        elif warp_idx < 8:
            cute.arch.setmaxregister_decrease(self.correction_regs)
            t = tile_range(*tile)
            scale_log2, _ = self.fold_descales(mQD, mKD, t.m_block, t.head, t.kv_head, t.batch,
                                               *self.scales(mFScalars, False))
            out_scale = self.output_descale(mVD, t.kv_head, t.batch, t.n_min)
            self.correction(tidx - 128, tOtO, mbar, sScale, sFinal, mO, mLSE, t.m_block, t.head,
                            t.batch, t.count, t.seqlen_q, scale_log2, out_scale)
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            t = tile_range(*tile)
            if warp_idx == _MMA_WARP:
                self.mma(qk_mma, pv_mma, sQ, sK, sV, tP_l, tStS, tOtO, mbar, pipes, t.count)
            elif warp_idx == _LOAD_WARP:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, qk_thr, pv_thr, pipes,
                          t.m_block, t.head, t.batch, t.n_max, t.count)
        _tmem_fence(after=False)
        cute.arch.barrier()
        if warp_idx == _MMA_WARP:
            _tmem_fence(after=True)
            cute.arch.dealloc_tmem(tmem, self.tmem_cols)

    @cute.jit
    def scales(self, mFScalars, softmax: cutlass.Constexpr):
        """(scale_log2, pre_scale): softcap folds into the exp2 scale as in the Hopper kernel
        (ALiBi slopes are in units of its divisor, softcap or softmax_scale); pre_scale =
        softmax_scale / softcap is divided only in the softmax warpgroup (the division's slow
        path is a call, which spilled at 168 registers)."""
        scale_log2 = mFScalars[int(self.cfg.has_softcap)] * LOG2_E
        pre_scale = Float32(1.0)
        if const_expr(self.cfg.has_softcap and softmax):
            pre_scale = mFScalars[0] / mFScalars[1]
        return scale_log2, pre_scale

    # ---------------------------------------------------------------- load warp
    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, qk_thr, pv_thr, pipes,
             m_block: Int32, head: Int32, batch: Int32, n_max: Int32, count: Int32):
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        gQ = cute.flat_divide(mQ[None, None, head, batch], (TILE_M, self.hd))
        gK = cute.flat_divide(mK[None, None, kv_head, batch], (self.tile_n, self.hd))
        gV = cute.flat_divide(mV[None, None, kv_head, batch], (self.hdv, self.tile_n))
        tQsQ, tQgQ = self.tma_views(tma_Q, sQ, qk_thr.partition_A(gQ))
        tKsK, tKgK = self.tma_views(tma_K, sK, qk_thr.partition_B(gK))
        tVsV, tVgV = self.tma_views(tma_V, sV, pv_thr.partition_B(gV))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        if count > 0:
            pq.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ[None, m_block, 0], tQsQ[None, 0],
                      tma_bar_ptr=pq.producer_get_barrier(q_state))
            for j in cutlass.range(count, unroll=1):
                n = n_max - 1 - j
                pk.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, n, 0], tKsK[None, k_state.index],
                          tma_bar_ptr=pk.producer_get_barrier(k_state))
                k_state.advance()
                pv.producer_acquire(v_state)
                cute.copy(tma_V, tVgV[None, 0, n], tVsV[None, v_state.index],
                          tma_bar_ptr=pv.producer_get_barrier(v_state))
                v_state.advance()

    @staticmethod
    def tma_views(atom, s, g):
        """(smem, gmem) views of a TMA copy of one MMA operand tile (no multicast)."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                     cute.group_modes(g, 0, 3))

    # ---------------------------------------------------------------- MMA warp
    @cute.jit
    def mma(self, qk_mma, pv_mma, sQ, sK, sV, tP_l, tStS, tOtO, mbar, pipes, count: Int32):
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tP = cute.make_tensor(tStS.iterator, tP_l.outer)
        tOrP = pv_thr.make_fragment_A(tP)[None, None, None, 0]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.num_stages)
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        if count > 0:
            pq.consumer_wait(q_state)
            # QK of block j + 1 is issued before PV of block j, so the softmax of j + 1 can
            # start while PV_j runs. No branch inside the loop: the MMAs' accumulate flag is IR
            # state of the tiled MMA and must be set where it is used.
            k_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, mbar, pk, k_state, Int32(0))
            for j in cutlass.range(count - 1, unroll=1):
                k_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, mbar, pk, k_state, j + 1)
                v_state = self.gemm_pv(pv_mma, tOrP, tOrV, tOtO, mbar, pv, v_state, j)
            v_state = self.gemm_pv(pv_mma, tOrP, tOrV, tOtO, mbar, pv, v_state, count - 1)

    @cute.jit
    def gemm_pv(self, pv_mma, tOrP, tOrV, tOtO, mbar, pv, v_state, j: Int32):
        """O (+)= P_j V_j once P_j is in TMEM and O holds the rescaled O_{j-1}; completion
        arrives on O_DONE and frees V_j's slot."""
        buf = j % 2
        cute.arch.mbarrier_wait(mbar + _P_FULL + buf, (j // 2) % 2)
        cute.arch.mbarrier_wait(mbar + _O_READY, j % 2)
        _tmem_fence(after=True)
        pv.consumer_wait(v_state)
        # P_buf's first element: two 16-bit (four 8-bit) ones per TMEM column
        p_elem = (32 // self.dtype.width) * (self.p_off[0] + buf * (self.p_off[1] - self.p_off[0]))
        tOrPj = cute.make_tensor(tOrP.iterator + p_elem, tOrP.layout)
        tOrVj = tOrV[None, None, None, v_state.index]
        mma = _fresh(pv_mma)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, (j > 0) | (k > 0))
            cute.gemm(mma, tOtO, tOrPj[None, None, k], tOrVj[None, None, k], tOtO)
        with cute.arch.elect_one():
            self.commit(mbar + _O_DONE)
        pv.consumer_release(v_state)
        v_state.advance()
        return v_state

    @cute.jit
    def gemm_qk(self, qk_mma, tSrQ, tSrK, tStS, mbar, pk, k_state, j: Int32):
        """S_{j % 2} = Q K_j^T; its completion arrives on S_FULL[j % 2], and frees K_j's slot."""
        buf = j % 2
        tSt = cute.make_tensor(tStS.iterator + buf * (self.s_off[1] - self.s_off[0]),
                               tStS.layout)
        pk.consumer_wait(k_state)
        tSrKj = tSrK[None, None, None, k_state.index]
        mma = _fresh(qk_mma)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, tSt, tSrQ[None, None, k, 0], tSrKj[None, None, k], tSt)
        with cute.arch.elect_one():
            self.commit(mbar + _S_FULL + buf)
        pk.consumer_release(k_state)
        k_state.advance()
        return k_state

    # ---------------------------------------------------------------- softmax warpgroup
    @cute.jit
    def score_mods(self, coords: TileCoords, m_block: Int32, segs):
        mQ, mK, mAlibi, mQSeg, mKVSeg, mQBlk, mKVBlk, alibi_unit, head, batch, desc, sSeg = segs
        mods = _Mods()
        dyn = self.descale_mods(mods, desc)
        if const_expr(self.cfg.has_alibi):
            mods.alibi = mAlibi[0, head] / alibi_unit
            dyn.append("alibi")
        if const_expr(self.cfg.has_segments):
            mods.rows = SegmentRows.load(coords, 1, m_block * TILE_M, mQSeg[batch, None],
                                         mQ.shape[0], mQBlk[batch, m_block, 0],
                                         mQBlk[batch, m_block, 1])
            mods.kv_seg = mKVSeg[batch, None]
            mods.kv_blk = mKVBlk[batch, None, None]
            mods.S = mK.shape[0]
            mods.sSeg = sSeg
            dyn += ["rows", "kv_seg", "kv_blk", "S", "sSeg"]
        mods._dynamic = tuple(dyn)
        return mods

    @cute.jit
    def softmax(self, tidx: Int32, qk_thr, tStS, mbar, sScale, sFinal, blocks: BlockRange,
                segs, m_block: Int32, n_min: Int32, n_max: Int32, count: Int32,
                seqlen_k: Int32, scale_log2: Float32, pre_scale: Float32, window_left: Int32,
                window_right: Int32):
        row = tidx % TILE_M
        ld_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tStS)
        thr_ld = tiled_ld.get_slice(row)
        tSt = thr_ld.partition_S(tStS)
        cS = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n)))
        tScS = thr_ld.partition_D(cS)
        t0ScS = tiled_ld.get_slice(0).partition_D(cS)
        # P: tile_n 16-bit (8-bit) values = tile_n / 2 (/ 4) columns, stored in up to
        # 32-column steps
        p_cols = self.tile_n * self.dtype.width // 32
        tStP = cute.make_tensor(tStS.iterator + (self.p_off[0] - self.s_off[0]),
                                cute.composition(tStS.layout, cute.make_layout((TILE_M, p_cols))))
        st_atom = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(min(32, p_cols))),
                                      Float32)
        tiled_st = tcgen05.make_tmem_copy(st_atom, tStP)
        thr_st = tiled_st.get_slice(row)
        tStP_t = thr_st.partition_D(tStP)
        cP = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n)))
        cP = cute.make_tensor(cP.iterator, cute.composition(cP.layout,
                                                            cute.make_layout((TILE_M, p_cols))))
        p_shape = thr_st.partition_S(cP).shape
        # the row as a (rows, cols) = (1, tile_n) view for the shared mask / ALiBi helpers
        flat = cute.make_layout(((2, 1, self.tile_n // 2), 1, 1))
        t0 = cute.make_tensor(t0ScS.iterator, cute.composition(t0ScS.layout, flat))
        coords = TileCoords(tScS[0][0], tScS[0][1], layouts.acc_as_rows_cols(t0))
        mods = self.score_mods(coords, m_block, segs)
        ctx = (tiled_ld, tSt, tScS.shape, tiled_st, tStP_t, p_shape, coords, flat)

        m_ref = Float32(-Float32.inf)
        row_sum = Float32(0.0)
        args = (mbar, sScale, blocks, mods, m_block, seqlen_k, scale_log2, pre_scale,
                window_left, window_right, ctx)
        if count > 0:
            n = n_max - 1
            m_ref, row_sum = self.step(Int32(0), n, m_ref, row_sum, True, True, self.has_right,
                                       self.has_left, *args)
            n_right = blocks.n_block_min_right_mask(m_block, n_min)
            c = cutlass.max(n - n_right, 0)
            for i in cutlass.range(c, unroll=1):
                m_ref, row_sum = self.step(n_max - n + i, n - 1 - i, m_ref, row_sum, False,
                                           False, self.has_right, self.has_left, *args)
            n = n - c
            n_left = blocks.n_block_min_no_left_mask(m_block, n_min)
            c = cutlass.max(n - n_left, 0)
            for i in cutlass.range(c, unroll=1):
                m_ref, row_sum = self.step(n_max - n + i, n - 1 - i, m_ref, row_sum, False,
                                           False, False, False, *args)
            n = n - c
            if const_expr(self.has_left):
                c = cutlass.max(n - n_min, 0)
                for i in cutlass.range(c, unroll=1):
                    m_ref, row_sum = self.step(n_max - n + i, n - 1 - i, m_ref, row_sum, False,
                                               False, self.has_right, True, *args)
        sFinal[row, 0] = row_sum
        sFinal[row, 1] = m_ref
        cute.arch.mbarrier_arrive(mbar + _FINAL)

    @cute.jit
    def step(self, j: Int32, n_block: Int32, m_ref: Float32, row_sum: Float32,
             is_first: cutlass.Constexpr, mask_seqlen: cutlass.Constexpr,
             mask_right: cutlass.Constexpr, mask_left: cutlass.Constexpr, mbar, sScale,
             blocks: BlockRange, mods, m_block: Int32, seqlen_k: Int32, scale_log2: Float32,
             pre_scale: Float32, window_left: Int32, window_right: Int32, ctx):
        """Key block j (n_block): S_j from TMEM -> masks -> row max -> P_j into TMEM."""
        tiled_ld, tSt, s_shape, tiled_st, tStP_t, p_shape, coords, flat = ctx
        row = coords.base_row
        buf = j % 2
        shift = buf * (self.s_off[1] - self.s_off[0])
        seg_cmp = None
        seg_id = None
        if const_expr(self.cfg.has_segments):
            seg_cmp = mods.rows.block_needs_compare(mods.kv_blk[n_block, 0],
                                                    mods.kv_blk[n_block, 1])
            # the id of one key of the block per thread, read before the wait; staged after it
            # (`segment_mask`): two buffers are enough, since QK_{j+2} is issued after PV_j,
            # which waits for every softmax thread's P_j (after its reads of block j's ids)
            seg_id = mods.kv_seg[cutlass.min(n_block * self.tile_n + row % self.tile_n,
                                             mods.S - 1)]
        cute.arch.mbarrier_wait(mbar + _S_FULL + buf, (j // 2) % 2)
        _tmem_fence(after=True)
        rS = cute.make_rmem_tensor(s_shape, Float32)
        cute.copy(tiled_ld, cute.make_tensor(tSt.iterator + shift, tSt.layout), rS)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read
        s = cute.make_tensor(rS.iterator, cute.composition(rS.layout, flat))
        self.block_scores(rS, mods, n_block)
        if const_expr(self.cfg.has_softcap):
            for i in cutlass.range_constexpr(cute.size(rS)):
                rS[i] = cute.math.tanh(rS[i] * pre_scale, fastmath=True)
        if const_expr(self.cfg.has_alibi):
            apply_alibi(s, coords, m_block * TILE_M, n_block * self.tile_n, mods.alibi)
        if const_expr(self.cfg.has_segments):
            if seg_cmp:
                segment_mask(s, coords, mods.rows, mods.sSeg[None, buf], seg_id, self.tile_n,
                             TILE_M, _BAR_SEG)
        if const_expr(mask_seqlen or mask_right or mask_left):
            apply_mask(s, coords, m_block, n_block, TILE_M, self.tile_n, seqlen_k,
                       window_left, window_right, mask_seqlen, mask_right, mask_left,
                       by_select=True)
        m_blk = rS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
        m_new = cute.arch.fmax(m_ref, m_blk)
        acc_scale = Float32(1.0)
        if const_expr(is_first):
            m_ref = m_new
        else:
            # conditional rescaling: keep the reference unless the max ran past it by more than
            # the threshold (-inf reference and a finite max: +inf, moves; both -inf: NaN, stays)
            grow = (m_new - m_ref) * scale_log2 > Float32(self.cfg.rescale_threshold)
            m_safe = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
            acc_scale = Float32(cutlass.select_(
                grow, cute.math.exp2((m_ref - m_safe) * scale_log2, fastmath=True),
                Float32(1.0)))
            m_ref = Float32(cutlass.select_(grow, m_new, m_ref))
        sScale[row, buf] = self.o_rescale(acc_scale, mods, n_block)
        cute.arch.mbarrier_arrive(mbar + _STATS + buf)
        ref = Float32(cutlass.select_(m_ref == -Float32.inf, Float32(0.0), m_ref))
        neg = -ref * scale_log2
        if const_expr(self.p_shift_log2 != 0):
            neg = neg + Float32(self.p_shift_log2)
        every = self.cfg.ex2_poly_every
        for i in cutlass.range_constexpr(0, cute.size(rS), 2):
            x0, x1 = cute.arch.fma_packed_f32x2((rS[i], rS[i + 1]), (scale_log2, scale_log2),
                                                (neg, neg))
            if const_expr(every > 0 and (i // 2) % every == every - 1):
                rS[i], rS[i + 1] = exp2_poly_pair(x0, x1)
            else:
                rS[i] = cute.math.exp2(x0, fastmath=True)
                rS[i + 1] = cute.math.exp2(x1, fastmath=True)
        # P in the operand type (16 or 8 bits), written over the S columns this thread has
        # read (`tmem_plan`)
        rP = cute.make_rmem_tensor(p_shape, Float32)
        rP16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), rS.layout)
        rP16.store(rS.load().to(self.dtype))
        cute.copy(tiled_st, rP, cute.make_tensor(tStP_t.iterator + shift, tStP_t.layout))
        cute.arch.fence_view_async_tmem_store()
        _tmem_fence(after=False)
        self.arrive_mma(mbar + _P_FULL + buf)
        acc = [Float32(0.0)] * 4
        for i in cutlass.range_constexpr(0, cute.size(rS), 8):
            acc[0], acc[1] = cute.arch.add_packed_f32x2((acc[0], acc[1]), (rS[i], rS[i + 1]))
            acc[2], acc[3] = cute.arch.add_packed_f32x2((acc[2], acc[3]),
                                                        (rS[i + 2], rS[i + 3]))
            acc[0], acc[1] = cute.arch.add_packed_f32x2((acc[0], acc[1]),
                                                        (rS[i + 4], rS[i + 5]))
            acc[2], acc[3] = cute.arch.add_packed_f32x2((acc[2], acc[3]),
                                                        (rS[i + 6], rS[i + 7]))
        row_sum = row_sum * acc_scale + ((acc[0] + acc[1]) + (acc[2] + acc[3]))
        return m_ref, row_sum

    # ---------------------------------------------------------------- correction warpgroup
    @cute.jit
    def correction(self, ct: Int32, tOtO, mbar, sScale, sFinal, mO, mLSE, m_block: Int32,
                   head: Int32, batch: Int32, count: Int32, seqlen_q: Int32,
                   scale_log2: Float32, out_scale: Optional[Float32]):
        """Rescale O's row in TMEM between PV_{j-1} and PV_j when its reference moved; then
        the epilogue for the row."""
        chunk = 32
        tOtO_c = cute.make_tensor(tOtO.iterator,
                                  cute.composition(tOtO.layout, cute.make_layout((TILE_M, chunk))))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(chunk)), Float32), tOtO_c)
        st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(chunk)), Float32), tOtO_c)
        thr_ld = ld.get_slice(ct)
        tO_ld = thr_ld.partition_S(tOtO_c)
        tO_st = st.get_slice(ct).partition_D(tOtO_c)
        r_shape = thr_ld.partition_D(tOtO_c).shape
        for j in cutlass.range(count, unroll=1):
            buf = j % 2
            cute.arch.mbarrier_wait(mbar + _STATS + buf, (j // 2) % 2)
            scale = sScale[ct, buf]
            # warp-uniform: touch O only if a row of the warp moved its reference; only then
            # wait for PV_{j-1}, so unmoved blocks let the MMA warp queue PV_j at once. (A
            # parity wait may skip phases: PV_j cannot complete before this warp's O_READY.)
            if j > 0:
                if cute.arch.vote_any_sync(scale != Float32(1.0)):
                    cute.arch.mbarrier_wait(mbar + _O_DONE, (j - 1) % 2)
                    _tmem_fence(after=True)
                    for c in cutlass.range_constexpr(self.hdv // chunk):
                        r = cute.make_rmem_tensor(r_shape, Float32)
                        cute.copy(ld, cute.make_tensor(tO_ld.iterator + c * chunk, tO_ld.layout),
                                  r)
                        cute.arch.fence_view_async_tmem_load()
                        for i in cutlass.range_constexpr(0, cute.size(r), 2):
                            r[i], r[i + 1] = cute.arch.mul_packed_f32x2((r[i], r[i + 1]),
                                                                        (scale, scale))
                        cute.copy(st, r, cute.make_tensor(tO_st.iterator + c * chunk,
                                                          tO_st.layout))
                    cute.arch.fence_view_async_tmem_store()
                    _tmem_fence(after=False)
            self.arrive_mma(mbar + _O_READY)

        # epilogue: O / rowsum in the output dtype, LSE in natural log
        cute.arch.mbarrier_wait(mbar + _FINAL, 0)
        total = sFinal[ct, 0]
        m_ref = sFinal[ct, 1]
        inv = Float32(0.0)
        lse = Float32(-Float32.inf)
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            lse2 = m_ref * scale_log2 + cute.math.log2(total, fastmath=True)
            if const_expr(self.p_shift_log2 != 0):
                lse2 = lse2 - Float32(self.p_shift_log2)  # the row sum carries P's 2^shift
            lse = lse2 * LN2
        if const_expr(out_scale is not None):
            inv = inv * out_scale
        if count > 0:
            cute.arch.mbarrier_wait(mbar + _O_DONE, (count - 1) % 2)
            _tmem_fence(after=True)
        row = m_block * TILE_M + ct
        if row < seqlen_q:
            mLSE[row, head, batch] = lse
        gO = mO[cutlass.min(row, mO.shape[0] - 1), None, head, batch]
        for c in cutlass.range_constexpr(self.hdv // chunk):
            r = cute.make_rmem_tensor(r_shape, Float32)
            r.fill(0.0)
            if count > 0:
                cute.copy(ld, cute.make_tensor(tO_ld.iterator + c * chunk, tO_ld.layout), r)
                cute.arch.fence_view_async_tmem_load()
            for i in cutlass.range_constexpr(0, cute.size(r), 2):
                r[i], r[i + 1] = cute.arch.mul_packed_f32x2((r[i], r[i + 1]), (inv, inv))
            r16 = cute.make_rmem_tensor(cute.make_layout(chunk), self.o_dtype)
            r16.store(r.load().to(self.o_dtype))
            if row < seqlen_q:
                cute.autovec_copy(r16, cute.local_tile(gO, (chunk,), (c,)))

