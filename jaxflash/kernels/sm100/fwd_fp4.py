"""FP4 Direct-P attention forward for Blackwell (sm_100a) in the CuTe DSL: `FlashFwdFp4Sm100`.

The non-causal inference forward of the FP4 paper (constants: `jaxflash.fp4.constants`, the
module the JAX emulator `jaxflash.fp4.direct_p` imports too). Shape of the kernel, shared with
`FlashFwdSm100` (`kernels/sm100/fwd.py`: the same three warpgroups, register budgets, tensor-
memory double buffering of S and mbarrier handshakes):

- 128 query rows of one (batch, head) per CTA, 384 threads: warpgroup 0 = softmax (thread t
  owns row t), warpgroup 1 = epilogue, warp 8 = MMA, warp 9 = load.
- Load warp: Q (NVFP4 payload by TMA, its E4M3 scales by one bulk copy onto the same
  mbarrier), then per key tile K and V^T (keys contiguous: FP4 MMAs take K-major operands) with
  their scale chunks, into a ring of ``num_stages``; key tiles left to right (the order the
  emulator sums the denominator in).
- MMA warp: scales SMEM -> TMEM by ``tcgen05.cp`` (32x128b, warpx4), then
  S_j = Q K_j^T by ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` (two K64 steps at
  D128) into one of two S buffers; O += P_j V_j by ``kind::mxf4nvf4.block_scale.block32`` with
  the A operand P_j read from tensor memory and its E8M0 scale pages (also in tensor memory,
  over retired S columns), one K64 half at a time as the softmax publishes it.
- Softmax (Direct-P), per N32 block of its row: block max -> E8M0 byte u_B (zero block if it
  underflows; with the guard u' = max(u, L + 1) - L) -> per score pair ONE packed FMA
  (``fma.rn.f32x2``: score scale, row reference, e_B, log2 6, A and B folded into one
  coefficient pair) and ONE packed convert with the max(0, .) folded in
  (``cvt.rn.satfinite.relu.e2m1x2.f32``); the accurate policy sends every fourth pair through
  the native EX2 instead. Each K64 half (two N32 blocks) is published on its own: its codes
  (8 words a row) go to tensor memory over the S columns already read (``tcgen05.st``), the
  row's scale bytes to that half's shared-memory page, which the MMA warp copies over retired
  S columns (``tcgen05.cp``: the MMA reads scale factors in a
  layout replicated over the four lane quarters, which the row-owning warps cannot write
  themselves). The denominator term alpha'_B * (c_B / 6) is built from the same codes
  (`direct_p.code_sum2`: byte permutes, carry-free adds, one DP4A).
- Epilogue: O = acc / (6 L) (the MMA applies P's E8M0 scale without Direct-P's 1/6:
  `constants.KERNEL_PV_SCALE`), LSE = m + L_shift ln 2 + ln L, O in bfloat16 straight from
  registers.

Not done here: two Q tiles per CTA (the paper's 16-warp ping-pong schedule), the accurate
policy's denominator in the correction warpgroup (here it stays in the softmax for both
policies), a persistent tile loop. Nothing here has run on a Blackwell GPU: compiled and
instruction-checked only.
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
import cutlass.utils.blockscaled_layout as bsl
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from jaxflash.fp4 import constants as C
from jaxflash.kernels.common import layouts
from jaxflash.kernels.sm100 import direct_p as dp
from jaxflash.kernels.sm100.fwd import _tmem_fence
from jaxflash.kernels.variants.sm100_fwd import REGS, TILE_M
from jaxflash.kernels.variants.sm100_fwd_fp4 import (P_HALF_COLS, P_HALVES, P_PAGE_COLS,
                                                     P_PAYLOAD_COLS, TILE_N, Sm100FwdFp4Config)

FP4 = cutlass.Float4E2M1FN
SF_QK = cutlass.Float8E4M3FN
SF_PV = cutlass.Float8E8M0FNU
LN2 = math.log(2.0)

_MMA_WARP = 8
_LOAD_WARP = 9
_S_FULL = 0     # [2] S_j in TMEM (tcgen05.commit)
_P_FULL = 2     # [2 x 2] half h of P_j: codes in TMEM + its scale page in SMEM (128 softmax
                #         threads); index 2 (j % 2) + h
_O_FINAL = 6    # the last PV complete (tcgen05.commit)
_FINAL = 7      # row denominators in shared memory (128 softmax threads)
_NUM_MBAR = 8


class FlashFwdFp4Sm100:
    """Blackwell FP4 Direct-P forward for one `Sm100FwdFp4Config`.

    Host entry (``@cute.jit __call__``): q, k, vt, sfq, sfk, sfv, qk_scale, [m_ref], o, lse,
    stream (layouts in `variants.sm100_fwd_fp4`).
    """

    def __init__(self, config: Sm100FwdFp4Config):
        ok, why = config.check()  # includes the tensor-memory plan
        if not ok:
            raise ValueError(why)
        self.cfg = config
        self.hd = self.hdv = config.head_dim
        self.num_stages = config.num_stages
        off = config.tmem_offsets()
        self.off = off
        self.tmem_cols = config.tmem_plan().alloc_cols
        # The PV MMA's A operand (P in TMEM) is addressed from the fragment's layout, i.e.
        # relative to TMEM address 0 (the DSL's convention, as in `FlashFwdSm100`): right only
        # when the CTA owns all 512 columns, so its allocation starts at lane 0, column 0.
        if self.tmem_cols != 512:
            raise ValueError(f"the FP4 forward allocates all 512 TMEM columns, not "
                             f"{self.tmem_cols}")
        self.softmax_regs, self.correction_regs, self.other_regs = REGS
        self.num_threads = 384
        pol = config.params
        self.A, self.B = float(pol["A"]), float(pol["B"])
        self.shift = config.guard_shift or 0
        self.sfq_bytes, self.sfk_bytes, self.sfv_bytes = config.sf_bytes()

    @classmethod
    def can_implement(cls, config: Sm100FwdFp4Config) -> tuple[bool, str]:
        return config.check()

    def launch_layout(self):
        ins = ["q", "k", "vt", "sfq", "sfk", "sfv", "qk_scale"]
        if self.cfg.has_row_ref:
            ins.append("m_ref")
        return tuple(ins), ("o", "lse"), (), ()

    # ------------------------------------------------------------------------------------
    # host
    # ------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ8: cute.Tensor, mK8: cute.Tensor, mVt8: cute.Tensor,
                 mSFQ: cute.Tensor, mSFK: cute.Tensor, mSFV: cute.Tensor,
                 mQKScale: cute.Tensor, *rest):
        if const_expr(self.cfg.has_row_ref):
            mRef, mO, mLSE, stream = rest
        else:
            mRef = None
            mO, mLSE, stream = rest
        self.launch(mQ8, mK8, mVt8, mSFQ, mSFK, mSFV, mQKScale, mRef, mO, mLSE, stream)

    @staticmethod
    def _as_fp4(t: cute.Tensor, order):
        """uint8 [..., X/2] (two codes a byte) -> an E2M1 tensor [..., X], modes reordered."""
        shape = t.shape[:-1] + (t.shape[-1] * 2,)
        stride = tuple(s * 2 for s in t.stride[:-1]) + (1,)
        f = cute.make_tensor(cute.recast_ptr(t.iterator, dtype=FP4),
                             cute.make_layout(shape, stride=stride))
        return layouts.select_modes(f, order)

    @cute.jit
    def launch(self, mQ8: cute.Tensor, mK8: cute.Tensor, mVt8: cute.Tensor, mSFQ: cute.Tensor,
               mSFK: cute.Tensor, mSFV: cute.Tensor, mQKScale: cute.Tensor,
               mRef: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               stream: cuda.CUstream):
        # [B, T, N, H] -> (T, H, N, B); V^T [B, K, Hv, S] -> (Hv, S, K, B): the PV MMA's B
        # operand is (N = Hv, K = keys) with the keys contiguous
        mQ = self._as_fp4(mQ8, [1, 3, 2, 0])
        mK = self._as_fp4(mK8, [1, 3, 2, 0])
        mVt = self._as_fp4(mVt8, [2, 3, 1, 0])
        mO = layouts.select_modes(mO, [1, 3, 2, 0])
        mLSE = layouts.select_modes(mLSE, [2, 1, 0])  # (T, N, B)

        K_ = OperandMajorMode.K
        one = tcgen05.CtaGroup.ONE
        qk_tiler = (TILE_M, TILE_N, self.hd)
        pv_tiler = (TILE_M, self.hdv, TILE_N)
        qk_mma = sm100_helpers.make_blockscaled_trivial_tiled_mma(
            FP4, FP4, K_, K_, SF_QK, C.QK_BLOCK, one, qk_tiler[:2])
        pv_mma = sm100_helpers.make_blockscaled_trivial_tiled_mma(
            FP4, FP4, K_, K_, SF_PV, C.V_BLOCK, one, pv_tiler[:2], tcgen05.OperandSource.TMEM)
        sQ_l = sm100_helpers.make_smem_layout_a(qk_mma, qk_tiler, FP4, 1)
        sK_l = sm100_helpers.make_smem_layout_b(qk_mma, qk_tiler, FP4, self.num_stages)
        sV_l = sm100_helpers.make_smem_layout_b(pv_mma, pv_tiler, FP4, self.num_stages)
        tP_l = sm100_helpers.make_smem_layout_a(pv_mma, pv_tiler, FP4, 1)
        sSFQ_l = bsl.make_smem_layout_sfa(qk_mma, qk_tiler, C.QK_BLOCK, 1)
        sSFK_l = bsl.make_smem_layout_sfb(qk_mma, qk_tiler, C.QK_BLOCK, self.num_stages)
        # one page per S buffer and K64 half: stage 2 (j % 2) + h
        sSFP_l = bsl.make_smem_layout_sfa(pv_mma, pv_tiler, C.V_BLOCK, 2 * P_HALVES)
        sSFV_l = bsl.make_smem_layout_sfb(pv_mma, pv_tiler, C.V_BLOCK, self.num_stages)
        # the host-side scale chunks are these layouts' bytes, one stage each
        for lay, nbytes in ((sSFQ_l, self.sfq_bytes), (sSFK_l, self.sfk_bytes),
                            (sSFP_l, TILE_M * TILE_N // C.P_BLOCK),
                            (sSFV_l, self.sfv_bytes)):
            if const_expr(cute.cosize(lay) != nbytes * cute.size(lay, mode=[3])):
                raise ValueError(f"scale-factor layout {lay} is not {nbytes} B a stage: the "
                                 "chunk order of variants.sm100_fwd_fp4 no longer matches")

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        one_q = cute.select(sQ_l, mode=[0, 1, 2])
        one_k = cute.select(sK_l, mode=[0, 1, 2])
        one_v = cute.select(sV_l, mode=[0, 1, 2])
        tma_Q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, one_q, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_K, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, one_k, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_V, tma_mV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mVt, one_v, pv_tiler, pv_mma,
                                                         cluster.shape)
        self.q_bytes = cute.size_in_bytes(FP4, one_q) + self.sfq_bytes
        self.k_bytes = cute.size_in_bytes(FP4, one_k) + self.sfk_bytes
        self.v_bytes = cute.size_in_bytes(FP4, one_v) + self.sfv_bytes

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar: cute.struct.MemRange[cutlass.Int64, _NUM_MBAR]
            tmem_holding: Int32
            row_final: cute.struct.MemRange[Float32, TILE_M]

        T = mQ.shape[0]
        num_m_blocks = (T + TILE_M - 1) // TILE_M
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        self.kernel(tma_mQ, tma_mK, tma_mV, mSFQ, mSFK, mSFV, mQKScale, mRef, mO, mLSE,
                    tma_Q, tma_K, tma_V, sQ_l, sK_l, sV_l, tP_l, sSFQ_l, sSFK_l, sSFP_l, sSFV_l,
                    qk_mma, pv_mma, num_m_blocks, SharedStorage).launch(
                        grid=[num_tiles, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                        min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------
    # device
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mSFQ: cute.Tensor,
               mSFK: cute.Tensor, mSFV: cute.Tensor, mQKScale: cute.Tensor,
               mRef: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
               sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout, sSFQ_l: cute.Layout, sSFK_l: cute.Layout,
               sSFP_l: cute.Layout, sSFV_l: cute.Layout, qk_mma: cute.TiledMma,
               pv_mma: cute.TiledMma, num_m_blocks: Int32, SharedStorage: cutlass.Constexpr):
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
                                 (_P_FULL + 1, 128), (_P_FULL + 2, 128), (_P_FULL + 3, 128),
                                 (_O_FINAL, 1), (_FINAL, 128)):
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

        # operand tiles (swizzled, 1024-byte aligned) and the scale-factor chunks
        sQ = smem.allocate_tensor(FP4, sQ_l.outer, byte_alignment=1024, swizzle=sQ_l.inner)
        sK = smem.allocate_tensor(FP4, sK_l.outer, byte_alignment=1024, swizzle=sK_l.inner)
        sV = smem.allocate_tensor(FP4, sV_l.outer, byte_alignment=1024, swizzle=sV_l.inner)
        sSFQ = smem.allocate_tensor(SF_QK, sSFQ_l, byte_alignment=128)
        sSFK = smem.allocate_tensor(SF_QK, sSFK_l, byte_alignment=128)
        sSFV = smem.allocate_tensor(SF_PV, sSFV_l, byte_alignment=128)
        sSFP = smem.allocate_tensor(SF_PV, sSFP_l, byte_alignment=128)
        # the P scale pages as 32-bit words: word (r % 32) * 4 + r // 32 of a page holds row
        # r's four E8M0 bytes (the atom order of `variants.sm100_fwd_fp4.scale_atom_offset`)
        sSFP_w = cute.make_tensor(cute.recast_ptr(sSFP.iterator, dtype=Int32),
                                  cute.make_layout((TILE_M, 2 * P_HALVES), stride=(1, TILE_M)))
        sFinal = storage.row_final.get_tensor(cute.make_layout(TILE_M))
        smem_sf = (sSFQ.iterator, sSFK.iterator, sSFV.iterator)

        bid, _, _ = cute.arch.block_idx()
        m_block = bid % num_m_blocks
        hb = bid // num_m_blocks
        head = hb % mQ.shape[2]
        batch = hb // mQ.shape[2]
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        count = (seqlen_k + TILE_N - 1) // TILE_N

        if warp_idx == _MMA_WARP:
            cute.arch.alloc_tmem(self.tmem_cols, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        pipeline.pipeline_init_wait()
        cute.arch.barrier()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, alignment=16,
                                           ptr_to_buffer_holding_addr=storage.tmem_holding.ptr)
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tStS = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_M, TILE_N)))
        tStS = cute.make_tensor(tmem + self.off["S0"], tStS.layout)
        tOtO = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_M, self.hdv)))
        tOtO = cute.make_tensor(tmem + self.off["O"], tOtO.layout)

        if warp_idx < 4:
            cute.arch.setmaxregister_increase(self.softmax_regs)
            self.softmax(tidx, qk_thr, tStS, mbar, sSFP_w, sFinal, mQKScale, mRef, m_block,
                         head, batch, count, seqlen_k)
        elif warp_idx < 8:
            cute.arch.setmaxregister_decrease(self.correction_regs)
            self.epilogue(tidx - 128, tOtO, mbar, sFinal, mRef, mO, mLSE, m_block, head, batch,
                          count, seqlen_q)
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            if warp_idx == _MMA_WARP:
                self.mma(qk_mma, pv_mma, sQ, sK, sV, tP_l, sSFQ, sSFK, sSFP, sSFV, tmem, tStS,
                         tOtO, mbar, pipes, count)
            elif warp_idx == _LOAD_WARP:
                self.load(mQ, mK, mVt, mSFQ, mSFK, mSFV, smem_sf, sQ, sK, sV, tma_Q, tma_K,
                          tma_V, qk_thr, pv_thr, pipes, m_block, head, batch, count)
        _tmem_fence(after=False)
        cute.arch.barrier()
        if warp_idx == _MMA_WARP:
            _tmem_fence(after=True)
            cute.arch.dealloc_tmem(tmem, self.tmem_cols)

    # ---------------------------------------------------------------- load warp
    @cute.jit
    def load(self, mQ, mK, mVt, mSFQ, mSFK, mSFV, smem_sf, sQ, sK, sV, tma_Q, tma_K, tma_V,
             qk_thr, pv_thr, pipes, m_block: Int32, head: Int32, batch: Int32, count: Int32):
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        gQ = cute.flat_divide(mQ[None, None, head, batch], (TILE_M, self.hd))
        gK = cute.flat_divide(mK[None, None, kv_head, batch], (TILE_N, self.hd))
        gV = cute.flat_divide(mVt[None, None, kv_head, batch], (self.hdv, TILE_N))
        tQsQ, tQgQ = self.tma_views(tma_Q, sQ, qk_thr.partition_A(gQ))
        tKsK, tKgK = self.tma_views(tma_K, sK, qk_thr.partition_B(gK))
        tVsV, tVgV = self.tma_views(tma_V, sV, pv_thr.partition_B(gV))
        sfq_s, sfk_s, sfv_s = smem_sf
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        pq.producer_acquire(q_state)
        cute.copy(tma_Q, tQgQ[None, m_block, 0], tQsQ[None, 0],
                  tma_bar_ptr=pq.producer_get_barrier(q_state))
        with cute.arch.elect_one():
            dp.bulk_g2s(sfq_s, mSFQ[batch, head, m_block, None].iterator, self.sfq_bytes,
                        pq.producer_get_barrier(q_state))
        for j in cutlass.range(count, unroll=1):
            pk.producer_acquire(k_state)
            bar = pk.producer_get_barrier(k_state)
            cute.copy(tma_K, tKgK[None, j, 0], tKsK[None, k_state.index], tma_bar_ptr=bar)
            with cute.arch.elect_one():
                dp.bulk_g2s(sfk_s + k_state.index * self.sfk_bytes,
                            mSFK[batch, kv_head, j, None].iterator, self.sfk_bytes, bar)
            k_state.advance()
            pv.producer_acquire(v_state)
            bar = pv.producer_get_barrier(v_state)
            cute.copy(tma_V, tVgV[None, 0, j], tVsV[None, v_state.index], tma_bar_ptr=bar)
            with cute.arch.elect_one():
                dp.bulk_g2s(sfv_s + v_state.index * self.sfv_bytes,
                            mSFV[batch, kv_head, j, None].iterator, self.sfv_bytes, bar)
            v_state.advance()

    @staticmethod
    def tma_views(atom, s, g):
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                     cute.group_modes(g, 0, 3))

    # ---------------------------------------------------------------- MMA warp
    @staticmethod
    def _sf_tmem(tmem, col, dtype, tmem_layout_fn, mma, tiler, vec, sS):
        """A scale-factor set in tensor memory from column ``col`` (may be dynamic)."""
        ptr = cute.recast_ptr(tmem + col, dtype=dtype)
        return cute.make_tensor(ptr, tmem_layout_fn(mma, tiler, vec,
                                                    cute.slice_(sS.layout,
                                                                (None, None, None, 0))))

    @staticmethod
    @cute.jit
    def _s2t(sS, tT, stage):
        """Scale factors of one stage SMEM -> TMEM (tcgen05.cp 32x128b.warpx4)."""
        cp = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), sS.element_type)
        tT_c = cute.filter_zeros(tT)
        s2t = tcgen05.make_s2t_copy(cp, tT_c)
        thr = s2t.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(cute.filter_zeros(sS)))
        cute.copy(s2t, src[None, None, None, None, stage], thr.partition_D(tT_c))

    @cute.jit
    def mma(self, qk_mma, pv_mma, sQ, sK, sV, tP_l, sSFQ, sSFK, sSFP, sSFV, tmem, tStS, tOtO,
            mbar, pipes, count: Int32):
        qk_tiler = (TILE_M, TILE_N, self.hd)
        pv_tiler = (TILE_M, self.hdv, TILE_N)
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tP = cute.make_tensor(tStS.iterator, tP_l.outer)
        tOrP = pv_thr.make_fragment_A(tP)[None, None, None, 0]
        o = self.off
        tSFQ = self._sf_tmem(tmem, o["SFQ"], SF_QK, bsl.make_tmem_layout_sfa, qk_mma, qk_tiler,
                             C.QK_BLOCK, sSFQ)
        sf = (tmem, sSFK, sSFP, sSFV, qk_tiler, pv_tiler)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.num_stages)
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        pq.consumer_wait(q_state)
        self._s2t(sSFQ, tSFQ, 0)
        # QK of tile j + 1 is issued before PV of tile j, so the softmax of j + 1 can start
        # while PV_j runs; tcgen05 operations of this thread run in issue order, so QK_{j+2}
        # cannot overwrite S/P_j before PV_j has read it.
        k_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, tSFQ, sf, mbar, pk, k_state,
                               Int32(0))
        for j in cutlass.range(count - 1, unroll=1):
            k_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, tSFQ, sf, mbar, pk, k_state, j + 1)
            v_state = self.gemm_pv(pv_mma, tOrP, tOrV, tOtO, sf, mbar, pv, v_state, j)
        v_state = self.gemm_pv(pv_mma, tOrP, tOrV, tOtO, sf, mbar, pv, v_state, count - 1)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + _O_FINAL)

    @cute.jit
    def gemm_qk(self, qk_mma, tSrQ, tSrK, tStS, tSFQ, sf, mbar, pk, k_state, j: Int32):
        """S_{j % 2} = Q K_j^T (NVFP4 x NVFP4, E4M3 scales per 16); K_j's scales go to the
        SFK set of its buffer first (tcgen05.cp runs before the MMAs: same issuing thread)."""
        tmem, sSFK, _, _, qk_tiler, _ = sf
        o = self.off
        buf = j % 2
        tSt = cute.make_tensor(tStS.iterator + buf * (o["S1"] - o["S0"]), tStS.layout)
        tSFK = self._sf_tmem(tmem, o["SFK0"] + buf * (o["SFK1"] - o["SFK0"]), SF_QK,
                             bsl.make_tmem_layout_sfb, qk_mma, qk_tiler, C.QK_BLOCK, sSFK)
        pk.consumer_wait(k_state)
        self._s2t(sSFK, tSFK, k_state.index)
        tSrKj = tSrK[None, None, None, k_state.index]
        mma = cute.make_tiled_mma(cute.make_mma_atom(qk_mma.op))
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            mma.set(tcgen05.Field.SFA, tSFQ[None, None, k].iterator)
            mma.set(tcgen05.Field.SFB, tSFK[None, None, k].iterator)
            cute.gemm(mma, tSt, tSrQ[None, None, k, 0], tSrKj[None, None, k], tSt)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + _S_FULL + buf)
        pk.consumer_release(k_state)
        k_state.advance()
        return k_state

    @cute.jit
    def gemm_pv(self, pv_mma, tOrP, tOrV, tOtO, sf, mbar, pv, v_state, j: Int32):
        """O (+)= P_j V_j (MXFP4 x MXFP4, E8M0 scales per 32 keys) in two K64 halves, each
        issued as soon as the softmax publishes it: its codes in tensor memory, its scale page
        copied from shared memory over retired S columns."""
        tmem, _, sSFP, sSFV, _, pv_tiler = sf
        o = self.off
        buf = j % 2
        over = buf * (o["P1"] - o["P0"])
        tSFV = self._sf_tmem(tmem, o["SFV0"] + buf * (o["SFV1"] - o["SFV0"]), SF_PV,
                             bsl.make_tmem_layout_sfb, pv_mma, pv_tiler, C.V_BLOCK, sSFV)
        # P_buf's first E2M1 element, relative to S0's column 0: eight per TMEM column
        tOrPj = cute.make_tensor(tOrP.iterator + 8 * (o["P0"] - o["S0"] + over), tOrP.layout)
        tOrVj = tOrV[None, None, None, v_state.index]
        mma = cute.make_tiled_mma(cute.make_mma_atom(pv_mma.op))
        for h in cutlass.range_constexpr(P_HALVES):
            tSFP = self._sf_tmem(tmem, o["P0"] + P_PAYLOAD_COLS + h * P_PAGE_COLS + over, SF_PV,
                                 bsl.make_tmem_layout_sfa, pv_mma, pv_tiler, C.V_BLOCK, sSFP)
            cute.arch.mbarrier_wait(mbar + _P_FULL + 2 * buf + h, (j // 2) % 2)
            _tmem_fence(after=True)
            if const_expr(h == 0):
                pv.consumer_wait(v_state)
                self._s2t(sSFV, tSFV, v_state.index)
            self._s2t(sSFP, tSFP, 2 * buf + h)
            # half h is MMA k-block h: its codes are columns 8h.., its scales bytes 2h, 2h + 1
            mma.set(tcgen05.Field.ACCUMULATE, (j > 0) | (h > 0))
            mma.set(tcgen05.Field.SFA, tSFP[None, None, h].iterator)
            mma.set(tcgen05.Field.SFB, tSFV[None, None, h].iterator)
            cute.gemm(mma, tOtO, tOrPj[None, None, h], tOrVj[None, None, h], tOtO)
        pv.consumer_release(v_state)
        v_state.advance()
        return v_state

    # ---------------------------------------------------------------- softmax warpgroup
    @cute.jit
    def softmax(self, tidx: Int32, qk_thr, tStS, mbar, sSFP_w, sFinal, mQKScale, mRef,
                m_block: Int32, head: Int32, batch: Int32, count: Int32, seqlen_k: Int32):
        row = tidx % TILE_M
        ld_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tStS)
        thr_ld = tiled_ld.get_slice(row)
        tSt = thr_ld.partition_S(tStS)
        cS = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        s_shape = thr_ld.partition_D(cS).shape
        # P codes: 128 E2M1 a row = 16 columns, one tcgen05.st of 8 columns per K64 half
        tStP = cute.make_tensor(tStS.iterator + (self.off["P0"] - self.off["S0"]),
                                cute.composition(tStS.layout,
                                                 cute.make_layout((TILE_M, P_HALF_COLS))))
        st_atom = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(P_HALF_COLS)),
                                      Int32)
        tiled_st = tcgen05.make_tmem_copy(st_atom, tStP)
        thr_st = tiled_st.get_slice(row)
        tStP_t = thr_st.partition_D(tStP)
        cP = cute.make_identity_tensor((TILE_M, P_HALF_COLS))
        p_shape = thr_st.partition_S(cP).shape

        # per-row constants: c = scale log2(e) / (G_q G_k); mc = m log2(e) (m: row reference)
        c = mQKScale[batch, head]
        mc = Float32(0.0)
        if const_expr(self.cfg.has_row_ref):
            mc = mRef[batch, head, cutlass.min(m_block * TILE_M + row, mRef.shape[2] - 1)] \
                * Float32(C.LOG2E)
        ac = c * Float32(self.A)
        # the page word of this row: byte b = block b's E8M0 (the scale-factor atom order)
        page_idx = (row % 32) * 4 + row // 32
        den = Float32(0.0)
        for j in cutlass.range(count - 1, unroll=1):
            den = self.step(j, den, False, tiled_ld, tSt, s_shape, tiled_st, tStP_t, p_shape,
                            mbar, sSFP_w, page_idx, c, ac, mc, seqlen_k)
        den = self.step(count - 1, den, True, tiled_ld, tSt, s_shape, tiled_st, tStP_t,
                        p_shape, mbar, sSFP_w, page_idx, c, ac, mc, seqlen_k)
        sFinal[row] = den
        cute.arch.mbarrier_arrive(mbar + _FINAL)

    @cute.jit
    def step(self, j: Int32, den: Float32, mask_tail: cutlass.Constexpr, tiled_ld, tSt,
             s_shape, tiled_st, tStP_t, p_shape, mbar, sSFP_w, page_idx: Int32, c: Float32,
             ac: Float32, mc: Float32, seqlen_k: Int32):
        """Key tile j: S_j from TMEM -> four N32 blocks of Direct-P codes + scale bytes ->
        codes to TMEM, scale page to SMEM, denominator terms added in block order."""
        buf = j % 2
        shift = buf * (self.off["S1"] - self.off["S0"])
        cute.arch.mbarrier_wait(mbar + _S_FULL + buf, (j // 2) % 2)
        _tmem_fence(after=True)
        rS = cute.make_rmem_tensor(s_shape, Float32)
        cute.copy(tiled_ld, cute.make_tensor(tSt.iterator + shift, tSt.layout), rS)
        cute.arch.fence_view_async_tmem_load()
        limit = seqlen_k - j * TILE_N   # keys past the sequence (last tile only): -inf
        rP = [cute.make_rmem_tensor(p_shape, Int32) for _ in range(P_HALVES)]
        neg_inf = Float32(-Float32.inf)
        page = Int32(0)
        A, B = self.A, self.B
        for b in cutlass.range_constexpr(TILE_N // C.P_BLOCK):
            base = b * C.P_BLOCK
            if const_expr(mask_tail):
                for i in cutlass.range_constexpr(base, base + C.P_BLOCK):
                    rS[i] = Float32(cutlass.select_(i < limit, rS[i], -Float32.inf))
            mx = rS[base]
            for i in cutlass.range_constexpr(1, C.P_BLOCK):
                mx = cute.arch.fmax(mx, rS[base + i])
            # e_B = floor(y_max + log2 6 - 2), y_max = max * c - m log2 e  ("ocp" rule)
            e = dp.floor_s32(mx * c + (Float32(C.P_SCALE_OCP_OFFSET) - mc))
            # (clamped first: cvt.rmi saturates +-inf to INT_MAX / INT_MIN)
            u = cutlass.min(cutlass.max(e, Int32(-(1 << 20))), Int32(1 << 20)) \
                + Int32(C.E8M0_BIAS)
            if const_expr(self.cfg.guard_shift is None):
                zero = u < Int32(C.E8M0_MIN_BYTE)
                u_work = cutlass.min(cutlass.max(u, Int32(C.E8M0_MIN_BYTE)),
                                     Int32(C.E8M0_MAX_BYTE))
            else:
                zero = mx == neg_inf
                u_work = cutlass.min(cutlass.max(u, Int32(self.shift + 1)),
                                     Int32(C.E8M0_MAX_BYTE))
            u_pub = u_work - Int32(self.shift)
            # x = s c + xb with xb = log2 6 - e_work - m log2 e; affine: A x + B = s (A c) + ab
            xb = Float32(C.LOG2_6) - Float32(u_work - Int32(C.E8M0_BIAS)) - mc
            xb = Float32(cutlass.select_(zero, neg_inf, xb))
            ab = xb * Float32(A) + Float32(B)
            for w in cutlass.range_constexpr(C.P_BLOCK // 8):
                v = [Float32(0.0)] * 8
                for p in cutlass.range_constexpr(4):
                    i = base + 8 * w + 2 * p
                    if const_expr(self.cfg.native_pair((8 * w + 2 * p) // 2)):
                        x0, x1 = cute.arch.fma_packed_f32x2((rS[i], rS[i + 1]), (c, c),
                                                            (xb, xb))
                        v[2 * p] = cute.math.exp2(x0, fastmath=True)
                        v[2 * p + 1] = cute.math.exp2(x1, fastmath=True)
                    else:
                        v[2 * p], v[2 * p + 1] = cute.arch.fma_packed_f32x2(
                            (rS[i], rS[i + 1]), (ac, ac), (ab, ab))
                rP[b // 2][(b % 2) * 4 + w] = dp.e2m1x8_relu(v)
            words = rP[b // 2]
            c2 = dp.code_sum2(words[(b % 2) * 4], words[(b % 2) * 4 + 1],
                              words[(b % 2) * 4 + 2], words[(b % 2) * 4 + 3])
            byte = Int32(cutlass.select_(zero, Int32(0), u_pub))
            page = page | (byte << Int32(8 * b))
            # alpha' (c_B / 6) = 2^(u' - 127) * (2 c_B * 1/12): alpha' last, never alpha'/6
            alpha = dp.as_f32(byte << Int32(23))
            den = den + alpha * (Float32(c2) * Float32(1.0 / (2.0 * C.E2M1_MAX)))
            if const_expr(b % 2 == 1):
                # a K64 half is complete: publish its codes and its page (bytes 2h, 2h + 1 are
                # the ones its MMA reads)
                h = b // 2
                cute.copy(tiled_st, rP[h],
                          cute.make_tensor(tStP_t.iterator + shift + h * P_HALF_COLS,
                                           tStP_t.layout))
                sSFP_w[page_idx, 2 * buf + h] = page
                cute.arch.fence_proxy("async.shared", space="cta")   # for tcgen05.cp
                cute.arch.fence_view_async_tmem_store()
                _tmem_fence(after=False)
                cute.arch.mbarrier_arrive(mbar + _P_FULL + 2 * buf + h)
        return den

    # ---------------------------------------------------------------- epilogue warpgroup
    @cute.jit
    def epilogue(self, ct: Int32, tOtO, mbar, sFinal, mRef, mO, mLSE, m_block: Int32,
                 head: Int32, batch: Int32, count: Int32, seqlen_q: Int32):
        """acc / (6 L) in bfloat16, LSE = m + L_shift ln 2 + ln L (natural log, logit units)."""
        chunk = 32
        tOtO_c = cute.make_tensor(tOtO.iterator,
                                  cute.composition(tOtO.layout, cute.make_layout((TILE_M, chunk))))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(chunk)), Float32), tOtO_c)
        thr_ld = ld.get_slice(ct)
        tO_ld = thr_ld.partition_S(tOtO_c)
        r_shape = thr_ld.partition_D(tOtO_c).shape
        cute.arch.mbarrier_wait(mbar + _FINAL, 0)
        den = sFinal[ct]
        row = m_block * TILE_M + ct
        m = Float32(0.0)
        if const_expr(self.cfg.has_row_ref):
            m = mRef[batch, head, cutlass.min(row, mRef.shape[2] - 1)]
        inv = Float32(0.0)
        lse = Float32(-Float32.inf)
        if den > Float32(0.0):
            inv = cute.arch.rcp_approx(den * Float32(C.KERNEL_PV_SCALE))
            lse = m + Float32(self.shift * LN2) + cute.math.log2(den, fastmath=True) \
                * Float32(LN2)
        cute.arch.mbarrier_wait(mbar + _O_FINAL, 0)
        _tmem_fence(after=True)
        if row < seqlen_q:
            mLSE[row, head, batch] = lse
        gO = mO[cutlass.min(row, mO.shape[0] - 1), None, head, batch]
        for ci in cutlass.range_constexpr(self.hdv // chunk):
            r = cute.make_rmem_tensor(r_shape, Float32)
            cute.copy(ld, cute.make_tensor(tO_ld.iterator + ci * chunk, tO_ld.layout), r)
            cute.arch.fence_view_async_tmem_load()
            for i in cutlass.range_constexpr(0, cute.size(r), 2):
                r[i], r[i + 1] = cute.arch.mul_packed_f32x2((r[i], r[i + 1]), (inv, inv))
            r16 = cute.make_rmem_tensor(cute.make_layout(chunk), cutlass.BFloat16)
            r16.store(r.load().to(cutlass.BFloat16))
            if row < seqlen_q:
                cute.autovec_copy(r16, cute.local_tile(gO, (chunk,), (ci,)))
