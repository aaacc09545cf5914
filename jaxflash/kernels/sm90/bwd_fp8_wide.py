"""FP8 FlashAttention backward for Hopper at head dim 256: `FlashBwdSm90Fp8Wide`.

`sm90.bwd_fp8.FlashBwdSm90Fp8` gives each consumer warpgroup 64 key rows of dK and dV: hd/2 +
hd/2 float32 accumulators a thread, 256 at hd 256 before S^T and dP^T. Here, as the bf16
`sm90.bwd_wide.FlashBwdSm90Wide`, the two consumer warpgroups split the *head dim*: one CTA per
64-key block, warpgroup w holding S^T / dP^T of query columns [32w, 32w + 32) (16 + 16 floats)
and dK, dV, dQ columns [w hd/2, (w + 1) hd/2) (64 + 64 + 64 at hd 256, dQ live only from its
GEMM to the flush). Everything else is the FP8 kernel's: the producer, the launch, the
transposed copies written by XLA (Q^T, dO^T, K^T with their k orders), the scales and their
units, the amax floor, `probs_grads` and `store_ds`.

Every GEMM reads both operands from shared memory (FP8 wgmma: K-major only):
    S^T  = K Q^T      A = K, B = Q (this warpgroup's 32 queries), k = head dim
    dP^T = V dO^T     A = V, B = dO
    dV  += P^T dO     A = P^T (keys x query positions), B = dO^T (this half of the head dim)
    dK  += dS^T Q     A = dS^T (keys x query positions), B = Q^T
    dQ   = dS K       A = dS (queries x key positions), B = K^T
so the step writes three 64 x 64 e4m3 tiles (`ds_buffers`): P^T and dS^T with a thread's 4
values of a key row and 16 queries ({2q, 2q+1, 2q+8, 2q+9}: the Q_ORDER positions 4q..4q+3 of
Q^T / dO^T) in one 32-bit store, dS in 16-bit stores (keys r, r + 8 adjacent: K_ORDER).

One dS scale per 64 x 64 block (the CTA's step; the contract's `bwd_kv_tile`): the amax of both
warpgroups through shared memory as in the FP8 kernel; its named barrier also publishes P^T,
so the dV GEMM is issued before dS^T is converted. Q / dO are released once dV and dK are done
(the dQ GEMM reads only dS and K^T): the producer loads the next step during dQ and its flush.
The three tiles have one buffer each: the flush's BAR_DQ, passed by every thread after its
warpgroup's wait for all three GEMMs, proves the other warpgroup is done reading them before the
next step overwrites them.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.mask import QueryBlockRange, SegmentRows, TileCoords
from jaxflash.kernels.sm90.bwd import _BAR_DS
from jaxflash.kernels.sm90.bwd_fp8 import (_BAR_AMAX, E4M3_MAX, P_SHIFT_LOG2, FlashBwdSm90Fp8,
                                           cvt_e4m3x4)
from jaxflash.kernels.variants.bwd_fp8 import AMAX_FLOOR, Fp8BwdConfig

# Buffers of the dS tile (`ds_buffers` of them, tile_m = tile_n = 64)
_PT, _DST, _DS = 0, 1, 2


class FlashBwdSm90Fp8Wide(FlashBwdSm90Fp8):
    """Hopper FP8 backward at head dim 256 (`Fp8BwdConfig.split == "headdim"`). Same launch
    interface as `FlashBwdSm90Fp8` (see `bwd_fp8_launch`)."""

    ds_buffers = 3  # P^T, dS^T, dS

    def __init__(self, config: Fp8BwdConfig):
        super().__init__(config)
        if config.split != "headdim":
            raise ValueError(f"FlashBwdSm90Fp8Wide serves head dims > 128, got {config.key}")

    def fp8_tiled_mmas(self):
        """Both warpgroups cover the 64 keys: S^T / dP^T split the queries, dK / dV / dQ the
        head dim. Plain Python."""
        K_ = cute.nvgpu.OperandMajorMode.K
        e4, e5 = self.dtype, self.do_dtype
        qs = (self.tile_n, self.tile_m // 2)
        mma_s = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, (1, 2, 1), qs)
        mma_dp = sm90_helpers.make_trivial_tiled_mma(e4, e5, K_, K_, Float32, (1, 2, 1), qs)
        mma_dk = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, (1, 2, 1),
                                                      (self.tile_n, self.hd // 2))
        mma_dv = sm90_helpers.make_trivial_tiled_mma(e4, e5, K_, K_, Float32, (1, 2, 1),
                                                      (self.tile_n, self.hdv // 2))
        mma_dq = sm90_helpers.make_trivial_tiled_mma(e4, e4, K_, K_, Float32, self.dq_atoms,
                                                      (64, self.dq_cols))
        return mma_s, mma_dp, mma_dk, mma_dv, mma_dq

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
        tdVrP = w_dv.make_fragment_A(w_dv.partition_A(sdS))
        tdVrdOt = w_dv.make_fragment_B(w_dv.partition_B(sdOt))
        tdKrdS = w_dk.make_fragment_A(w_dk.partition_A(sdS))
        tdKrQt = w_dk.make_fragment_B(w_dk.partition_B(sQt))
        tdQrdS = w_dq.make_fragment_A(w_dq.partition_A(sdS))
        tdQrKt = w_dq.make_fragment_B(w_dq.partition_B(sKt))
        shape_st = (self.tile_n, self.tile_m)
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = self.tile_accumulators(t_s, t_dk, t_dv, t_dq)
        coords = TileCoords.make(mma_s, tidx, shape_st)
        tdQsdQ = self.dq_flat_partition(sdQ, tidx)
        sdS32 = cute.make_tensor(cute.recast_ptr(sdS16.iterator, dtype=Int32),
                                 cute.make_layout(cute.cosize(sdS_l) // 4))
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
                # P^T x 2^8 to e4m3 (this warpgroup's query columns of the P^T tile)
                self.store_rows_t(acc_S, coords, None, sdS32, sdS_l, _PT)
                for off in (16, 8, 4, 2, 1):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
                if lane == 0:
                    sAmax[cw, buf] = amax
                cute.arch.fence_view_async_shared()  # P^T -> visible to wgmma
                # both halves of P^T and every warp's |dS| max are in shared memory
                cute.arch.barrier(barrier_id=_BAR_AMAX, number_of_threads=self.num_mma_threads)
                layouts.wgmma(mma_dv, acc_dV, tdVrP[None, None, None, _PT],
                              tdVrdOt[None, None, None, stage], zero_init=False, wait=-1)
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
                # dS^T (keys x query positions, for dK) and dS (queries x key positions, for
                # dQ), x ds_inv to e4m3
                self.store_rows_t(acc_dP, coords, ds_inv, sdS32, sdS_l, _DST)
                self.store_ds(acc_dP, coords, ds_inv, sdS16, sdS_l, _DS)
                uk = ds_scale * qd
                # (in a branch, as dV's: unconditional, LLVM sinks the multiplies past the
                # dK GEMM's wgmma fence and ptxas then injects a warpgroup.arrive, C7519)
                if uk != unit_k:
                    rk = unit_k / uk
                    for i in cutlass.range_constexpr(cute.size(acc_dK)):
                        acc_dK[i] = acc_dK[i] * rk
                unit_k = uk
                cute.arch.fence_view_async_shared()  # smem writes -> visible to wgmma
                if warp_idx == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ's last reduce
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=self.num_mma_threads)
                layouts.wgmma(mma_dk, acc_dK, tdKrdS[None, None, None, _DST],
                              tdKrQt[None, None, None, stage], zero_init=False, wait=-1)
                layouts.wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, _DS], tdQrKt,
                              zero_init=True, wait=1)
                # dV and dK done (groups complete in order): Q, Q^T, dO, dO^T are free
                pipe_q.consumer_release(state)
                pipe_do.consumer_release(state)
                state.advance()
                warpgroup.wait_group(0)
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

    def store_rows_t(self, acc, coords: TileCoords, inv, s32: cute.Tensor, layout, buf: int):
        """acc (keys x this warpgroup's queries; x inv unless None) to e4m3 into buffer `buf`
        of the dS tile, rows = keys, queries at their Q_ORDER positions: per key row and 16
        queries a thread holds {2q, 2q+1, 2q+8, 2q+9} (accumulator columns 4c..4c+3 of the
        rows-cols view), positions 4q..4q+3: one 32-bit store. Plain Python (inlined)."""
        d = layouts.acc_as_rows_cols(acc)
        t0 = coords.t0
        col = coords.base_col + t0[0, 0][1]  # 16 c0 + 2q
        pos = col - col % 16 + 2 * (col % 16)
        for r in range(cute.size(d, mode=[0])):
            key = coords.base_row + t0[r, 0][0]
            for c in range(cute.size(d, mode=[1]) // 4):
                v = [d[r, 4 * c + i] for i in range(4)]
                if inv is not None:
                    v = [x * inv for x in v]
                word = cvt_e4m3x4(v[0], v[1], v[2], v[3])
                s32[cute.crd2idx((key, pos + 16 * c, buf), layout) >> 2] = word
