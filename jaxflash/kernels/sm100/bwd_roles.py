"""The Blackwell backward's compute and dQ-reduce warpgroups (`FlashBwdSm100`'s mixin), and the
kernel's handshakes.

Compute warpgroup w (warps 4 + 4w .. 7 + 4w), thread t = key row t of the CTA's block, reads
the query columns [64 w, 64 w + 64) of S^T and dP^T from tensor memory and writes its 16-bit
P^T and dS^T over the first 32 of them (`tmem_plan.backward_plan` proves that no other reader
is overrun), dS^T also into shared memory for the dQ MMA. The dQ reduce warpgroup (warps 0-3),
thread t = query row t, moves each step's dQ out of tensor memory into the float32 accumulator
in global memory by TMA reduce-adds.

The passes of a hd 256 backward (`FlashBwdSm100`'s ``bwd_pass``) are static branches here:
"dv" computes and stores P^T only (no dP^T, dS^T or dQ); "dkdq" takes 64-query steps, keeps
P^T in registers (no dV MMA reads it) and reduces dQ^T (`reduce_dq_t`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import tcgen05

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.dq_order import pass_turn, wait_turn
from jaxflash.kernels.common.mask import (SegmentRows, TileCoords, apply_alibi,
                                          apply_mask_kq, apply_segment_mask)
from jaxflash.kernels.variants.sm100_bwd import DQ_CHUNK, TILE_N

MMA_WARP = 12
LOAD_WARP = 13
# mbarriers of the kernel's own handshakes (index into `SharedStorage.mbar`)
S_FULL = 0     # S^T in TMEM (tcgen05.commit)
DP_FULL = 1    # dP^T in TMEM (tcgen05.commit)
P_FULL = 2     # P^T in TMEM (256 compute threads)
DS_FULL = 3    # dS^T in TMEM and shared memory (256 compute threads)
DQ_FULL = 4    # the step's dQ in TMEM; the dQ MMA has read dS from shared memory (commit)
DQ_EMPTY = 5   # dQ read out of TMEM (128 reduce threads)
DKV_FULL = 6   # dK and dV complete (commit after the last step)
NUM_MBAR = 7
_BAR_REDUCE = 1  # named barrier of the dQ reduce warpgroup
DQT_Q = 32  # queries per reduce-add box of dQ^T (32 x 32 float32: one per reduce warp)


@dsl_user_op
def tmem_fence(after: bool, *, loc=None, ip=None):
    """tcgen05.fence::after_thread_sync (after an mbarrier wait, before tcgen05 work that
    depends on what the arriving threads did) or ::before_thread_sync (after tcgen05 work,
    before the arrive that publishes it)."""
    kind = (nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after
            else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)
    nvvm.tcgen05_fence(kind, loc=loc, ip=ip)


def fresh(tiled_mma):
    """A new tiled MMA of the same op: the accumulate flag is IR state of the object, so each
    issue site sets its own."""
    return cute.make_tiled_mma(cute.make_mma_atom(tiled_mma.op))


def _cols(t: cute.Tensor, first: int, cols: int):
    """Columns [first, first + cols) of a 128-lane TMEM accumulator view (all lanes)."""
    return cute.make_tensor(t.iterator + first,
                            cute.composition(t.layout, cute.make_layout((128, cols))))


class BwdRoles:
    """Mixin of `FlashBwdSm100`: needs ``cfg``, ``dtype``, ``hd``, ``hdv`` and the plan's
    column offsets."""

    # ---------------------------------------------------------------- compute warpgroups
    @cute.jit
    def compute(self, ct: Int32, tm, mbar, smem_t, pipes, mdK, mdV, blocks, walk,
                seqlen_k: Int32, softmax_scale: Float32, scale_log2: Float32,
                pre_scale: Float32, window_left: Int32, window_right: Int32, alibi, segs,
                T: Int32):
        n_block, kv_head, batch, group, m_min, num_m, num_steps = walk
        mAlibi, mdAlibi = alibi
        mQSeg, mKVSeg, mKVBlk, mQBlk = segs
        half = self.tile_m // 2  # query columns per compute warpgroup
        wg = ct // 128
        lane = ct % 128
        col0 = wg * half
        ld_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
        st_atom = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(half // 2)),
                                      Float32)
        tS = _cols(tm["S"], 0, half)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, tS)
        thr_ld = tiled_ld.get_slice(lane)
        tS_t = thr_ld.partition_S(tS)
        cS = cute.make_identity_tensor((TILE_N, half))
        tScS = thr_ld.partition_D(cS)
        t0ScS = tiled_ld.get_slice(0).partition_D(cS)
        tP = _cols(tm["S"], 0, half // 2)
        tiled_st = tcgen05.make_tmem_copy(st_atom, tP)
        thr_st = tiled_st.get_slice(lane)
        tP_t = thr_st.partition_D(tP)
        p_shape = thr_st.partition_S(cute.make_identity_tensor((TILE_N, half // 2))).shape
        # the row as a (rows, cols) = (1, 64) view for the shared mask helpers
        flat = cute.make_layout(((2, 1, half // 2), 1, 1))
        t0 = cute.make_tensor(t0ScS.iterator, cute.composition(t0ScS.layout, flat))
        coords = TileCoords(tScS[0][0], tScS[0][1] + col0, layouts.acc_as_rows_cols(t0))
        # dS^T into shared memory: this thread's key row, its warpgroup's query columns
        sdSw = smem_t["sdSw"]
        if const_expr(self.has_dkdq):
            sdS_row = cute.local_tile(sdSw[lane, None, 0], (half,), (wg,))
        sLSE, sDelta = smem_t["sLSE"], smem_t["sDelta"]
        s_shift = col0  # this warpgroup's S^T / dP^T columns
        if const_expr(self.has_dv):
            p_shift = (self.p_off[1] - self.p_off[0]) * wg + self.p_off[0] - self.s_off
        if const_expr(self.has_dkdq):
            ds_shift = (self.ds_off[1] - self.ds_off[0]) * wg + self.ds_off[0] - self.s_off
            dp_shift = self.dp_off - self.s_off
        pq, pdo = pipes["q"], pipes["do"]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.num_stages)
        dslope = Float32(0.0)
        key_segs = None
        if const_expr(self.cfg.has_segments):  # this thread's key's id, the block's (min, max)
            key_segs = SegmentRows.load(coords, 1, n_block * TILE_N, mKVSeg[batch, None],
                                        mKVSeg.shape[1], mKVBlk[batch, n_block, 0],
                                        mKVBlk[batch, n_block, 1])
        for i in cutlass.range(num_steps, unroll=1):
            g = i // num_m
            m_block = m_min + i - g * num_m
            stage = state.index
            pq.consumer_wait(state)  # lse2 of the step in shared memory
            cute.arch.mbarrier_wait(mbar + S_FULL, i % 2)
            tmem_fence(after=True)
            rS = cute.make_rmem_tensor(tScS.shape, Float32)
            cute.copy(tiled_ld, cute.make_tensor(tS_t.iterator + s_shift, tS_t.layout), rS)
            cute.arch.fence_view_async_tmem_load()
            if const_expr(self.cfg.has_softcap):
                for j in cutlass.range_constexpr(cute.size(rS)):
                    rS[j] = cute.math.tanh(rS[j] * pre_scale, fastmath=True)
            if const_expr(self.cfg.has_alibi):
                # the slope in S^T units (the exp2 applies the softmax scale to the whole score);
                # |key - query| is symmetric, so the forward's helper serves the transposed tile
                apply_alibi(cute.make_tensor(rS.iterator, cute.composition(rS.layout, flat)),
                            coords, n_block * TILE_N, m_block * self.tile_m,
                            mAlibi[0, kv_head * group + g] / softmax_scale)
            if const_expr(self.cfg.has_segments):
                # most block pairs of packed documents lie inside one document: no compare
                if key_segs.block_needs_compare(mQBlk[batch, m_block, 0],
                                                mQBlk[batch, m_block, 1]):
                    apply_segment_mask(
                        cute.make_tensor(rS.iterator, cute.composition(rS.layout, flat)),
                        coords, key_segs, m_block * self.tile_m, mQSeg[batch, None], T)
            if blocks.needs_mask(n_block, m_block, seqlen_k):
                s = cute.make_tensor(rS.iterator, cute.composition(rS.layout, flat))
                apply_mask_kq(s, coords, n_block, m_block, TILE_N, self.tile_m, seqlen_k,
                              window_left, window_right, self.has_right, self.has_left)
            # P^T = exp2(S^T scale - lse2) in 8-value chunks: each rounded to 16 bits for the
            # dV MMA, and kept in rS as P^T (times 1 - tanh^2 under softcap, the derivative
            # dS^T needs: masked entries clamp to t = -1, where P^T is 0 anyway), so no second
            # 64-float array is live.
            rP = cute.make_rmem_tensor(p_shape, Float32)
            rP16 = cute.recast_ptr(rP.iterator, dtype=self.dtype)
            for j0 in cutlass.range_constexpr(0, cute.size(rS), 8):
                tmp = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                for e in cutlass.range_constexpr(0, 8, 2):
                    j = j0 + e
                    lse_a = sLSE[col0 + t0ScS[j][1], stage]
                    lse_b = sLSE[col0 + t0ScS[j + 1][1], stage]
                    if const_expr(self.cfg.has_softcap):
                        # (scalar: the packed form keeps more live and spilled at hd 128)
                        x0 = rS[j] * scale_log2 - lse_a
                        x1 = rS[j + 1] * scale_log2 - lse_b
                    else:  # S^T scale - lse2 by pairs (FFMA2)
                        x0, x1 = cute.arch.fma_packed_f32x2(
                            (rS[j], rS[j + 1]), (scale_log2, scale_log2), (-lse_a, -lse_b))
                    tmp[e] = cute.math.exp2(x0, fastmath=True)
                    tmp[e + 1] = cute.math.exp2(x1, fastmath=True)
                if const_expr(self.has_dv):  # ("dkdq" needs P^T in registers only)
                    cute.make_tensor(rP16 + j0, cute.make_layout(8)).store(
                        tmp.load().to(self.dtype))
                for e in cutlass.range_constexpr(8):
                    if const_expr(self.cfg.has_softcap):
                        t = cute.arch.fmax(rS[j0 + e], Float32(-1.0))
                        rS[j0 + e] = tmp[e] * (Float32(1.0) - t * t)
                    else:
                        rS[j0 + e] = tmp[e]
            if const_expr(self.has_dv):
                cute.copy(tiled_st, rP, cute.make_tensor(tP_t.iterator + p_shift, tP_t.layout))
                cute.arch.fence_view_async_tmem_store()
                tmem_fence(after=False)
                cute.arch.mbarrier_arrive(mbar + P_FULL)
            if const_expr(self.has_dkdq):
                pdo.consumer_wait(state)  # delta of the step in shared memory
                cute.arch.mbarrier_wait(mbar + DP_FULL, i % 2)
                tmem_fence(after=True)
                rdP = cute.make_rmem_tensor(tScS.shape, Float32)
                cute.copy(tiled_ld, cute.make_tensor(tS_t.iterator + dp_shift + s_shift,
                                                     tS_t.layout), rdP)
                cute.arch.fence_view_async_tmem_load()
                for j in cutlass.range_constexpr(cute.size(rS)):
                    delta = sDelta[col0 + t0ScS[j][1], stage]
                    rdP[j] = rS[j] * (rdP[j] - delta)
                self.store_16bit(rdP, p_shape, tiled_st, tP_t, ds_shift)
                # the previous step's dQ MMA has read dS from shared memory once its dQ is in
                # TMEM
                if i > 0:
                    cute.arch.mbarrier_wait(mbar + DQ_FULL, (i - 1) % 2)
                rdS = cute.make_rmem_tensor(cute.make_layout(half), self.dtype)
                rdS.store(rdP.load().to(self.dtype))
                cute.autovec_copy(rdS, sdS_row)
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> the MMA's reads
                cute.arch.mbarrier_arrive(mbar + DS_FULL)
                if const_expr(self.cfg.has_alibi):
                    # (after dS^T is published: its float copy is still in registers)
                    dslope = self.alibi_grad(rdP, coords, n_block, m_block,
                                             m_min + num_m - 1, kv_head * group + g, batch,
                                             ct // 32, mdAlibi, dslope)
            state.advance()
        self.store_dkdv(wg, lane, tm, mbar, mdK, mdV, n_block, kv_head, batch, seqlen_k,
                        num_steps, softmax_scale)

    @cute.jit
    def alibi_grad(self, rdS, coords: TileCoords, n_block: Int32, m_block: Int32,
                   m_last: Int32, head: Int32, batch: Int32, warp: Int32, mdAlibi,
                   dslope: Float32):
        """Add this step's sum dS_ij |i - j| to the thread's d(slope) partial; after the
        head's last query block, reduce it over the warp and let lane 0 write
        alibi_parts[batch, head, n_block, compute warp] (no atomics: deterministic)."""
        # |i - j| in integers here: the float form of `mask.alibi_distance_dot` is the very
        # expression `apply_alibi` computed on S^T, and ptxas kept those 64 values live from
        # there to here (CSE) and spilled ~170 bytes.
        d0 = n_block * TILE_N + coords.base_row - m_block * self.tile_m - coords.base_col
        t0 = coords.t0
        for j in cutlass.range_constexpr(cute.size(rdS)):
            d = d0 - t0[0, j][1]
            dslope = dslope + rdS[j] * Float32(cutlass.max(d, -d))
        if m_block == m_last:
            total = cute.arch.warp_reduction_sum(dslope)
            if cute.arch.lane_idx() == 0:
                mdAlibi[batch, head, n_block, warp] = total
            dslope = Float32(0.0)
        return dslope

    @cute.jit
    def store_16bit(self, r: cute.Tensor, p_shape, tiled_st, tP_t, shift: int):
        """r (64 floats) rounded to the input dtype and stored over the thread's own columns
        at ``shift`` (two values per column), then published to the MMA warp's next fence."""
        rP = cute.make_rmem_tensor(p_shape, Float32)
        rP16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), r.layout)
        rP16.store(r.load().to(self.dtype))
        cute.copy(tiled_st, rP, cute.make_tensor(tP_t.iterator + shift, tP_t.layout))
        cute.arch.fence_view_async_tmem_store()
        tmem_fence(after=False)

    @cute.jit
    def store_dkdv(self, wg: Int32, lane: Int32, tm, mbar, mdK, mdV, n_block: Int32,
                   kv_head: Int32, batch: Int32, seqlen_k: Int32, num_steps: Int32,
                   softmax_scale: Float32):
        """Epilogue: warpgroup wg's half of the dK (times the softmax scale) and dV columns
        of key row ``lane``, from TMEM to global memory (zeros if no query saw the block)."""
        if num_steps > 0:
            cute.arch.mbarrier_wait(mbar + DKV_FULL, 0)
            tmem_fence(after=True)
        key = n_block * TILE_N + lane
        outs = []  # the pass's accumulators ("all": dV then dK)
        if const_expr(self.has_dv):
            outs.append((tm["dV"], mdV, self.hdv, None))
        if const_expr(self.has_dkdq):
            outs.append((tm["dK"], mdK, self.hd, softmax_scale))
        for acc, mOut, width, scale in outs:
            half = width // 2
            chunk = min(32, half)
            tC = _cols(acc, 0, chunk)
            ld = tcgen05.make_tmem_copy(
                cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(chunk)), Float32), tC)
            thr = ld.get_slice(lane)
            tC_t = thr.partition_S(tC)
            r_shape = thr.partition_D(cute.make_identity_tensor((128, chunk))).shape
            gRow = mOut[cutlass.min(key, mOut.shape[0] - 1), None, kv_head, batch]
            for c in cutlass.range_constexpr(half // chunk):
                r = cute.make_rmem_tensor(r_shape, Float32)
                r.fill(0.0)
                if num_steps > 0:
                    cute.copy(ld, cute.make_tensor(tC_t.iterator + wg * half + c * chunk,
                                                   tC_t.layout), r)
                    cute.arch.fence_view_async_tmem_load()
                if const_expr(scale is not None):
                    for j in cutlass.range_constexpr(cute.size(r)):
                        r[j] = r[j] * scale
                r16 = cute.make_rmem_tensor(cute.make_layout(chunk), self.dtype)
                r16.store(r.load().to(self.dtype))
                if key < mOut.shape[0]:  # rows past seqlen_k hold zeros (P = 0 there)
                    cute.autovec_copy(r16, cute.local_tile(gRow, (chunk,), (wg * (half // chunk)
                                                                            + c,)))

    # ---------------------------------------------------------------- dQ reduce warpgroup
    @cute.jit
    def reduce_dq(self, rt: Int32, tm, mbar, sdQ, mdQ, tma_dQ, mSem, blocks, walk):
        """Per step: dQ (query row ``rt``) out of TMEM in 32-column chunks, each staged in
        one of two shared buffers and added into the float32 accumulator by one TMA
        reduce-add (warp 0's elected lane); in key-block order under ``deterministic``."""
        n_block, kv_head, batch, group, m_min, num_m, num_steps = walk
        warp = rt // 32
        tC = _cols(tm["dQ"], 0, DQ_CHUNK)
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(DQ_CHUNK)), Float32), tC)
        thr = ld.get_slice(rt)
        tC_t = thr.partition_S(tC)
        r_shape = thr.partition_D(cute.make_identity_tensor((128, DQ_CHUNK))).shape
        n_chunks = self.hd // DQ_CHUNK
        for i in cutlass.range(num_steps, unroll=1):
            g = i // num_m
            m_block = m_min + i - g * num_m
            head = kv_head * group + g
            gdQ = cute.local_tile(mdQ[None, None, head, batch], (self.tile_m, DQ_CHUNK),
                                  (None, None))
            tQs, tQg = layouts.tma_tiles(tma_dQ, sdQ, gdQ)
            sem = None
            if const_expr(self.cfg.deterministic):
                sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
            cute.arch.mbarrier_wait(mbar + DQ_FULL, i % 2)
            tmem_fence(after=True)
            for c in cutlass.range_constexpr(n_chunks):
                r = cute.make_rmem_tensor(r_shape, Float32)
                cute.copy(ld, cute.make_tensor(tC_t.iterator + c * DQ_CHUNK, tC_t.layout), r)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(c == n_chunks - 1):
                    tmem_fence(after=False)
                    cute.arch.mbarrier_arrive(mbar + DQ_EMPTY)
                # the reduce that last read this buffer (two chunks ago) is done reading
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
                cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
                sRow = sdQ[rt, None, c % 2]
                cute.autovec_copy(r, cute.make_tensor(sRow.iterator, sRow.layout))
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
                if warp == 0:
                    if const_expr(self.cfg.deterministic and c == 0):
                        wait_turn(sem, n_block - blocks.n_block_first(m_block))
                    with cute.arch.elect_one():
                        cute.copy(tma_dQ, tQs[None, c % 2], tQg[None, m_block, c])
                        cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.cfg.deterministic):
                if warp == 0:
                    pass_turn(sem)
        if warp == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def reduce_dq_t(self, rt: Int32, tm, mbar, sdQ, mdQ, tma_dQ, mSem, blocks, walk):
        """The "dkdq" pass: per step dQ^T (thread ``rt`` = head dim rt of each 128-dim half,
        the step's queries on the columns) out of TMEM 32 queries at a time. Each warp stages
        its 32 head dims x 32 queries as a 32 x 32 float32 box (query q is one 128-byte row
        that the warp's 32 lanes write together: no bank conflict) in its own shared buffer
        and adds it into the accumulator with one TMA reduce-add (its elected lane); in
        key-block order under ``deterministic`` (every warp's adds done before the release)."""
        n_block, kv_head, batch, group, m_min, num_m, num_steps = walk
        warp = rt // 32
        lane = rt % 32
        q_chunk = DQT_Q
        tC = _cols(tm["dQ"], 0, q_chunk)
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(q_chunk)), Float32), tC)
        thr = ld.get_slice(rt)
        tC_t = thr.partition_S(tC)
        r_shape = thr.partition_D(cute.make_identity_tensor((128, q_chunk))).shape
        n_half = self.hd // 128
        n_q = self.tile_m // q_chunk
        sBox = sdQ[None, lane, warp]  # this lane's head dim in the warp's box
        for i in cutlass.range(num_steps, unroll=1):
            g = i // num_m
            m_block = m_min + i - g * num_m
            head = kv_head * group + g
            gdQ = cute.local_tile(mdQ[None, None, head, batch], (q_chunk, DQ_CHUNK),
                                  (None, None))
            tQs, tQg = layouts.tma_tiles(tma_dQ, sdQ, gdQ)
            sem = None
            if const_expr(self.cfg.deterministic):
                sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
                if warp == 0:
                    wait_turn(sem, n_block - blocks.n_block_first(m_block))
                cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
                cute.arch.fence_proxy("async.global")  # every warp's adds after the acquire
            cute.arch.mbarrier_wait(mbar + DQ_FULL, i % 2)
            tmem_fence(after=True)
            for h in cutlass.range_constexpr(n_half):
                for c in cutlass.range_constexpr(n_q):
                    r = cute.make_rmem_tensor(r_shape, Float32)
                    cute.copy(ld, cute.make_tensor(tC_t.iterator + h * self.tile_m
                                                   + c * q_chunk, tC_t.layout), r)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(h == n_half - 1 and c == n_q - 1):
                        tmem_fence(after=False)
                        cute.arch.mbarrier_arrive(mbar + DQ_EMPTY)
                    # this warp's previous reduce-add is done reading its box
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.sync_warp()
                    for q in cutlass.range_constexpr(q_chunk):
                        sBox[q] = r[q]
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_warp()
                    with cute.arch.elect_one():
                        cute.copy(tma_dQ, tQs[None, warp],
                                  tQg[None, m_block * n_q + c, h * (128 // DQ_CHUNK) + warp])
                        cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.cfg.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds have landed
                cute.arch.fence_proxy("async.global")
                cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
                if warp == 0:
                    pass_turn(sem)
        cute.arch.cp_async_bulk_wait_group(0, read=True)
