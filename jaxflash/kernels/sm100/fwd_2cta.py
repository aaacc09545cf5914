"""The Blackwell forward with 2-CTA MMAs: `FlashFwdSm100Pair` (``Sm100FwdConfig.two_cta``).

A cluster of two CTAs takes two consecutive 128-row tiles of one (batch, head). The first CTA's
MMA warp issues every MMA of the pair as one ``tcgen05.mma.cta_group::2`` of M = 256: each CTA
holds its own 128 rows of Q, S, P and O (in its own shared and tensor memory) and *half* of each
K tile (tile_n / 2 keys) and of each V tile (head_dim / 2 value columns), so the pair reads K and
V once from L2 where two 1-CTA tiles read them twice. What changes against `FlashFwdSm100`:

- TMA loads with the 2-CTA copy op: each CTA loads its halves, and their bytes complete on the
  leader CTA's barriers (its transaction count is both CTAs' bytes); the leader's MMA warp
  frees a stage in both CTAs with one multicast ``tcgen05.commit``.
- The MMA-completion barriers (S full, PV done) are committed to both CTAs (multicast); the
  softmax's "P written" and the correction's "O rescaled" arrive on the leader's barriers
  (remote arrives from the second CTA: 256 arrivals each).
- Tensor memory is allocated with ``cta_group::2``, freed after a cluster barrier.
- Both CTAs must walk the same key blocks, so dense calls only (`Sm100FwdConfig.check`), and a
  second tile past the query length still runs its loop (its rows are not stored).

The softmax, masks, correction and epilogue are the 1-CTA kernel's code, reading each CTA's own
tensor memory with the per-CTA (128-row) layouts. Compiled and instruction-checked only.
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.mask import BlockRange
from jaxflash.kernels.common.scheduler import TileScheduler
from jaxflash.kernels.sm100.fwd import (_FINAL, _LOAD_WARP, _MMA_WARP, _NUM_MBAR, _O_DONE,
                                        _O_READY, _P_FULL, _S_FULL, _STATS, LOG2_E,
                                        FlashFwdSm100, _tmem_fence)
from jaxflash.kernels.variants.fwd import L2_SECTION_MB
from jaxflash.kernels.variants.sm100_fwd import TILE_M, Sm100FwdConfig

_PAIR = 2


class FlashFwdSm100Pair(FlashFwdSm100):
    """`FlashFwdSm100` on CTA pairs with 2-CTA MMAs (same host entry and tensors)."""

    def __init__(self, config: Sm100FwdConfig):
        super().__init__(config)
        if not config.two_cta:
            raise ValueError(f"{config.key}: FlashFwdSm100Pair needs two_cta=True")

    # ---------------------------------------------------------------- hooks
    def commit(self, mbar_ptr):
        """Completion of the pair's MMAs, signalled in both CTAs."""
        tcgen05.commit(mbar_ptr, 0b11, tcgen05.CtaGroup.TWO)

    def arrive_mma(self, mbar_ptr):
        """Onto the leader CTA's barrier (rank 0 of the cluster), from either CTA, at cluster
        scope: the leader's MMAs then read what this CTA wrote to its tensor memory."""
        cute.arch.mbarrier_arrive(mbar_ptr, peer_cta_rank_in_cluster=0,
                                  scope=nvvm.MemScopeKind.CLUSTER)

    # ---------------------------------------------------------------- host
    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mQSeqlen: Optional[cute.Tensor], mKVSeqlen: Optional[cute.Tensor],
               mAlibi: Optional[cute.Tensor], mQSeg: Optional[cute.Tensor],
               mKVSeg: Optional[cute.Tensor], mQBlk: Optional[cute.Tensor],
               mKVBlk: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               mFScalars: cute.Tensor, mIScalars: Optional[cute.Tensor], stream: cuda.CUstream,
               mQD: Optional[cute.Tensor], mKD: Optional[cute.Tensor],
               mVD: Optional[cute.Tensor]):
        for t in (mQ, mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        mQ, mK, mO = [layouts.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mV = layouts.select_modes(mV, [3, 1, 2, 0])
        mLSE = layouts.select_modes(mLSE, [2, 1, 0])

        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one, two = tcgen05.CtaGroup.ONE, tcgen05.CtaGroup.TWO
        # the pair's MMAs: M = 256 over the two CTAs
        qk_tiler = (_PAIR * TILE_M, self.tile_n, self.hd)
        pv_tiler = (_PAIR * TILE_M, self.hdv, self.tile_n)
        qk_mma = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, K_, Float32, two,
                                                      qk_tiler[:2])
        pv_mma = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, MN, Float32, two,
                                                      pv_tiler[:2], tcgen05.OperandSource.TMEM)
        # one CTA's share, as 1-CTA MMAs: the tensor-memory layouts the softmax and the
        # correction read (each CTA holds 128 rows x N columns of S and O)
        qk_cta = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, K_, Float32, one,
                                                      (TILE_M, self.tile_n))
        pv_cta = sm100_helpers.make_trivial_tiled_mma(self.dtype, K_, MN, Float32, one,
                                                      (TILE_M, self.hdv),
                                                      tcgen05.OperandSource.TMEM)
        sQ_l = sm100_helpers.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, 1)
        sK_l = sm100_helpers.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.num_stages)
        sV_l = sm100_helpers.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.num_stages)
        tP_l = sm100_helpers.make_smem_layout_a(pv_mma, pv_tiler, self.dtype, 1)

        cluster = cute.tiled_divide(cute.make_layout((_PAIR, 1, 1)), (qk_mma.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(two)
        one_q = cute.select(sQ_l, mode=[0, 1, 2])
        one_k = cute.select(sK_l, mode=[0, 1, 2])
        one_v = cute.select(sV_l, mode=[0, 1, 2])
        tma_Q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, one_q, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_K, tma_mK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, one_k, qk_tiler, qk_mma,
                                                         cluster.shape)
        tma_V, tma_mV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mV, one_v, pv_tiler, pv_mma,
                                                         cluster.shape)
        # both CTAs' bytes complete on the leader's barrier
        self.q_bytes = cute.size_in_bytes(self.dtype, one_q) * _PAIR
        self.k_bytes = cute.size_in_bytes(self.dtype, one_k) * _PAIR
        self.v_bytes = cute.size_in_bytes(self.dtype, one_v) * _PAIR

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar: cute.struct.MemRange[cutlass.Int64, _NUM_MBAR]
            tmem_holding: Int32
            row_scale: cute.struct.MemRange[Float32, 2 * TILE_M]
            row_final: cute.struct.MemRange[Float32, 2 * TILE_M]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_l)], 1024]

        T = mQ.shape[0]
        num_pairs = (T + _PAIR * TILE_M - 1) // (_PAIR * TILE_M)
        num_tiles = _PAIR * num_pairs * mQ.shape[2] * mQ.shape[3]
        scheduler = TileScheduler(lpt=False, section_bytes=L2_SECTION_MB * 1024 * 1024)
        self.kernel_pair(tma_mQ, tma_mK, tma_mV, mO, mLSE, mKVSeqlen, mAlibi, tma_Q, tma_K,
                         tma_V, mFScalars, sQ_l, sK_l, sV_l, tP_l, qk_mma, pv_mma, qk_cta,
                         pv_cta, scheduler, num_pairs, SharedStorage).launch(
            grid=[num_tiles, 1, 1], block=[self.num_threads, 1, 1], cluster=[_PAIR, 1, 1],
            stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel_pair(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mKVSeqlen: Optional[cute.Tensor],
                    mAlibi: Optional[cute.Tensor], tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom,
                    tma_V: cute.CopyAtom, mFScalars: cute.Tensor, sQ_l: cute.ComposedLayout,
                    sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
                    tP_l: cute.ComposedLayout, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
                    qk_cta: cute.TiledMma, pv_cta: cute.TiledMma, scheduler: cutlass.Constexpr,
                    num_pairs: Int32, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        leader = rank == 0
        if warp_idx == _LOAD_WARP:
            for atom in (tma_Q, tma_K, tma_V):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                # P written / O rescaled: both CTAs' 128 threads arrive on the leader's
                for i, count in ((_S_FULL, 1), (_S_FULL + 1, 1), (_P_FULL, 256),
                                 (_P_FULL + 1, 256), (_STATS, 128), (_STATS + 1, 128),
                                 (_O_READY, 256), (_O_DONE, 1), (_FINAL, 128)):
                    cute.arch.mbarrier_init(mbar + i, count)
        cta_vmnk = cute.tiled_divide(cute.make_layout((_PAIR, 1, 1)), (qk_mma.thr_id.shape,))
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipes = {}
        for name, stages, nbytes, store in (("q", 1, self.q_bytes, storage.mbar_q),
                                            ("k", self.num_stages, self.k_bytes, storage.mbar_k),
                                            ("v", self.num_stages, self.v_bytes, storage.mbar_v)):
            pipes[name] = pipeline.PipelineTmaUmma.create(
                num_stages=stages, producer_group=one_thread, consumer_group=one_thread,
                tx_count=nbytes, barrier_storage=store.data_ptr(), cta_layout_vmnk=cta_vmnk,
                defer_sync=True)
        cluster_mn = cute.make_layout((_PAIR, 1))
        pipeline.pipeline_init_arrive(cluster_mn, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        sScale = storage.row_scale.get_tensor(cute.make_layout((TILE_M, 2)))
        sFinal = storage.row_final.get_tensor(cute.make_layout((TILE_M, 2)))

        softmax_scale = mFScalars[0]
        pre_scale = Float32(1.0)
        scale_log2 = softmax_scale * LOG2_E
        alibi_unit = softmax_scale
        if const_expr(self.cfg.has_softcap):
            softcap = mFScalars[1]
            scale_log2 = softcap * LOG2_E
            alibi_unit = softcap
        blocks = BlockRange(TILE_M, self.tile_n, False, False, Int32(0), Int32(0))
        bid, _, _ = cute.arch.block_idx()
        S = mK.shape[0]
        kv_bytes = S * (self.hd + self.hdv) * (self.dtype.width // 8)
        pair, head, batch = scheduler.decode(bid // _PAIR, num_pairs, mQ.shape[2], mQ.shape[3],
                                             kv_bytes)
        m_block = pair * _PAIR + rank
        # the pair's key range (dense: the same for both tiles, whatever their rows)
        seqlen_q = mQ.shape[0]
        seqlen_k = S
        if const_expr(mKVSeqlen is not None):
            seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
        n_min, n_max = blocks.n_block_min_max(pair * _PAIR, seqlen_q, seqlen_k)
        count = cutlass.max(n_max - n_min, 0)
        kv_head = head // (mQ.shape[2] // mK.shape[2])

        if warp_idx == _MMA_WARP:
            cute.arch.alloc_tmem(self.tmem_cols, storage.tmem_holding.ptr, is_two_cta=True)
            cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
        pipeline.pipeline_init_wait(cluster_mn)
        cute.arch.barrier()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, alignment=16,
                                           ptr_to_buffer_holding_addr=storage.tmem_holding.ptr)
        cta_thr = qk_cta.get_slice(0)
        pv_cta_thr = pv_cta.get_slice(0)
        tStS = cta_thr.make_fragment_C(cta_thr.partition_shape_C((TILE_M, self.tile_n)))
        tStS = cute.make_tensor(tmem + self.s_off[0], tStS.layout)
        tOtO = pv_cta_thr.make_fragment_C(pv_cta_thr.partition_shape_C((TILE_M, self.hdv)))
        tOtO = cute.make_tensor(tmem + self.o_off, tOtO.layout)

        if warp_idx < 4:
            cute.arch.setmaxregister_increase(self.softmax_regs)
            if const_expr(self.cfg.has_softcap):
                pre_scale = pre_scale * (softmax_scale / mFScalars[1])
            segs = (mQ, mK, mAlibi, None, None, None, None, alibi_unit, head, batch,
                    (None, None, kv_head, batch), None)
            self.softmax(tidx, cta_thr, tStS, mbar, sScale, sFinal, blocks, segs, m_block,
                         n_min, n_max, count, seqlen_k, scale_log2, pre_scale, Int32(0),
                         Int32(0))
        elif warp_idx < 8:
            cute.arch.setmaxregister_decrease(self.correction_regs)
            self.correction(tidx - 128, tOtO, mbar, sScale, sFinal, mO, mLSE, m_block, head,
                            batch, count, seqlen_q, scale_log2, None)
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            if warp_idx == _MMA_WARP:
                if leader:
                    self.mma_pair(qk_mma, pv_mma, sQ, sK, sV, tP_l, tmem, mbar, pipes, count)
            elif warp_idx == _LOAD_WARP:
                self.load_pair(mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, qk_mma, pv_mma,
                               pipes, rank, pair, head, batch, n_max, count)
        _tmem_fence(after=False)
        cute.arch.barrier()
        # neither CTA frees its tensor memory while the pair's last MMAs may touch it
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if warp_idx == _MMA_WARP:
            _tmem_fence(after=True)
            cute.arch.dealloc_tmem(tmem, self.tmem_cols, is_two_cta=True)

    @cute.jit
    def load_pair(self, mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, qk_mma, pv_mma, pipes,
                  rank: Int32, pair: Int32, head: Int32, batch: Int32, n_max: Int32,
                  count: Int32):
        """This CTA's halves: its 128 rows of the pair's Q tile, half the keys of each K tile
        and half the value columns of each V tile (the 2-CTA MMA's operand split)."""
        kv_head = head // (mQ.shape[2] // mK.shape[2])
        qk_thr = qk_mma.get_slice(rank)
        pv_thr = pv_mma.get_slice(rank)
        gQ = cute.flat_divide(mQ[None, None, head, batch], (_PAIR * TILE_M, self.hd))
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
            cute.copy(tma_Q, tQgQ[None, pair, 0], tQsQ[None, 0],
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

    @cute.jit
    def mma_pair(self, qk_mma, pv_mma, sQ, sK, sV, tP_l, tmem, mbar, pipes, count: Int32):
        """The leader's MMA warp: the 1-CTA schedule (QK_{j+1} before PV_j) with the pair's
        M = 256 MMAs, accumulating into both CTAs' tensor memory at the same columns."""
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tStS = qk_thr.make_fragment_C(qk_thr.partition_shape_C((_PAIR * TILE_M, self.tile_n)))
        tStS = cute.make_tensor(tmem + self.s_off[0], tStS.layout)
        tOtO = pv_thr.make_fragment_C(pv_thr.partition_shape_C((_PAIR * TILE_M, self.hdv)))
        tOtO = cute.make_tensor(tmem + self.o_off, tOtO.layout)
        self.mma(qk_mma, pv_mma, sQ, sK, sV, tP_l, tStS, tOtO, mbar, pipes, count)
