"""FlashAttention backward for Hopper at head dims 192 / 256: `FlashBwdSm90Wide`.

`sm90.bwd.FlashBwdSm90` gives each consumer warpgroup 64 key rows of dK and dV (hd/2 + hd/2
floats per thread): 256 registers of accumulators at hd 256, more than setmaxnreg's 240. Here
(the FlashAttention-3 hdim-256 idea, written from the description) the two consumer warpgroups
split the *head dim* instead:

- One CTA per (key block n of ``tile_n`` = 64, kv head, batch); producer warp 0 as in the base
  kernel (K, V once; Q + LSE, dO + delta per step). Same GQA loop, masks, LSE / delta inputs,
  dQ accumulator (staged tile, reduce-add) and deterministic semaphores: only `launch` (the
  tiled MMAs and shared-memory layouts) and `consume` (the step) differ.
- Per step, warpgroup w (0 or 1):
    S^T[:, 32w:32w+32]  = K Q^T      64 keys x 32 queries, K-dim hd (SS)
    dP^T[:, 32w:32w+32] = V dO^T     (SS)
    P^T, dS^T of those columns (16 + 16 floats per thread), bf16 -> shared memory (stmatrix);
    named barrier: both halves of P^T and dS^T are there.
    dV[:, w half] += P^T dO[:, w half]      64 x hd/2, A = P^T smem (K-major), B = dO^T (MN)
    dK[:, w half] += dS^T Q[:, w half]      A = dS^T smem, B = Q^T (MN)
    dQ[:, w half]  = dS K[:, w half]        64 queries x hd/2, A = dS (MN view), B = K^T (MN)
  so every GEMM reads both operands from shared memory and the registers hold dK, dV (hd/4 each:
  64 + 64 at hd 256), the 16 + 16 of S^T / dP^T, and dQ's hd/4 (64) once S^T / dP^T are dead.
- Q / dO are released as soon as the dV and dK GEMMs are done (the dQ GEMM reads only dS^T and
  K), so the producer loads the next step during dQ and its flush (what makes one stage usable).
- Buffer reuse: P^T / dS^T have one buffer: the flush's BAR_DQ, which each thread passes after
  its warpgroup's wait for all three GEMMs, proves the other warpgroup is done reading them
  before the next step overwrites them.
- Epilogue as the base kernel: dK * scale and dV through K's and V's buffers, TMA stores.

Every shared-memory tile read as an MN-major operand in hd/2-column slices (Q, dO, K) is laid
out with swizzle atoms that fit hd/2 columns (hd 192: 96 = 3 x 32-column 64B atoms).
"""
from __future__ import annotations

from typing import Optional


import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.sm90.bwd import _BAR_DS, FlashBwdSm90
from jaxflash.kernels.common.mask import QueryBlockRange, apply_mask_kq


class FlashBwdSm90Wide(FlashBwdSm90):
    """Hopper backward for head dims 192 / 256 (`BwdConfig.split == "headdim"`). Same launch
    interface as `FlashBwdSm90` (see `bwd_launch`)."""

    def __init__(self, config: BwdConfig):
        super().__init__(config)
        if config.split != "headdim":
            raise ValueError(f"FlashBwdSm90Wide serves head dims > 128, got {config.key}")

    # Only the MMAs and the shared-memory layouts differ from `FlashBwdSm90.launch` (which
    # asks for them); ALiBi and segment tensors never reach this class: `BwdConfig.check`
    # refuses those features at the wide head dims.
    def tiled_mmas(self):
        K_, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        half, halfv = self.hd // 2, self.hdv // 2
        # S^T, dP^T: 64 keys x tile_m queries, the queries split over the warpgroups.
        tiled_mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(self.tile_n, self.tile_m // 2))
        # dK += dS^T Q, dV += P^T dO: both operands in smem, the head dim split.
        tiled_mma_dk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(self.tile_n, half))
        tiled_mma_dv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(self.tile_n, halfv))
        # dQ = dS K: 64 queries x hd, the head dim split.
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atom_layout_mnk=(1, 2, 1),
            tiler_mn=(self.tile_m, half))
        return tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq

    def smem_layouts(self):
        half, halfv = self.hd // 2, self.hdv // 2
        # Q, dO and K are MN-major operands in hd/2-column slices: atoms that fit a slice.
        sQ_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hd, self.num_stages,
                                        atom_cols=half)
        sdO_layout = layouts.smem_layout(self.dtype, self.tile_m, self.hdv, self.num_stages,
                                         atom_cols=halfv)
        sK_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hd, atom_cols=half)
        # V too: the dV epilogue stores each warpgroup's hd/2 columns into it (stmatrix).
        sV_layout = layouts.smem_layout(self.dtype, self.tile_n, self.hdv, atom_cols=halfv)
        # P^T (index 0) and dS^T (index 1), one buffer each (see the module docstring)
        sdS_layout = layouts.smem_layout(self.dtype, self.tile_n, self.tile_m, 2)
        sRow_layout = self.row_layout()
        sdQ_layout = (self.dq_flat_layout() if self.dq_flat
                      else layouts.smem_layout(Float32, self.tile_m, self.hd, atom_cols=half))
        return (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sRow_layout,
                sdQ_layout)

    @cute.jit
    def consume(self, mdQ, mdK, mdV, sQ, sK, sV, sdO, sPdS, sLSE, sDelta, sdQ, tma_dK, tma_dV,
                tma_dQ, pipe_kv, pipe_q, pipe_do, tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv,
                tiled_mma_dq, tidx: Int32, warp_idx: Int32, softmax_scale: Float32,
                pre_scale: Float32, scale_log2: Float32, window_left: Int32,
                window_right: Int32, n_block: Int32, kv_head: Int32, batch: Int32,
                group: Int32, m_min: Int32, num_m: Int32, num_steps: Int32, seqlen_k: Int32,
                T: Int32, mSem: Optional[cute.Tensor], blocks: QueryBlockRange, feats):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dk = tiled_mma_dk.get_slice(wg * 128)
        wg_dv = tiled_mma_dv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_dk = tiled_mma_dk.get_slice(tidx)
        thr_dv = tiled_mma_dv.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        # Operand fragments (smem descriptors): this warpgroup's query half (S^T, dP^T) or head
        # dim half (dK, dV, dQ); P^T / dS^T whole (both halves, written by both warpgroups).
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrP = wg_dv.make_fragment_A(wg_dv.partition_A(sPdS))
        tdVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(layouts.transpose_mn(sdO)))
        tdKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(sPdS))
        tdKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(layouts.transpose_mn(sQ)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(layouts.transpose_mn(sPdS)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(layouts.transpose_mn(sK)))
        (acc_S, acc_dP, acc_dK, acc_dV, acc_dQ, coords, st_atom, thr_st_pds, tPsPdS,
         tdQsdQ) = self.consumer_tiles(tiled_mma_sdp, tiled_mma_dq, thr_sdp, thr_dk, thr_dv,
                                       thr_dq, tidx, sPdS, sdQ)

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
                if blocks.needs_mask(n_block, m_block, seqlen_k):
                    apply_mask_kq(acc_S, coords, n_block, m_block, self.tile_n, self.tile_m,
                                  seqlen_k, window_left, window_right, self.has_right,
                                  self.has_left)
                warpgroup.wait_group(0)
                self.probs_and_grads(acc_S, acc_dP, coords, sLSE, sDelta, stage, scale_log2)
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))
                # This warpgroup's query columns of P^T and dS^T (the buffer is free: see the
                # module docstring).
                cute.copy(st_atom, thr_st_pds.retile(rP), tPsPdS[None, None, None, 0])
                cute.copy(st_atom, thr_st_pds.retile(rdS), tPsPdS[None, None, None, 1])
                cute.arch.fence_view_async_shared()  # smem writes -> visible to wgmma
                if warp_idx == 4:
                    # The previous step's reduce has read sdQ once this barrier is passed.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=self.num_mma_threads)
                layouts.wgmma(tiled_mma_dv, acc_dV, tdVrP[None, None, None, 0],
                              tdVrdOt[None, None, None, stage], zero_init=False, wait=-1)
                layouts.wgmma(tiled_mma_dk, acc_dK, tdKrdS[None, None, None, 1],
                              tdKrQt[None, None, None, stage], zero_init=False, wait=-1)
                # dV and dK done (groups complete in order) -> Q and dO are free: the producer
                # loads the next step while dQ runs and is flushed.
                layouts.wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, 1], tdQrKt,
                              zero_init=True, wait=1)
                pipe_q.consumer_release(state)
                pipe_do.consumer_release(state)
                state.advance()
                warpgroup.wait_group(0)
                self.flush_dq(mdQ, sdQ, tdQsdQ, tma_dQ, acc_dQ, m_block, head, batch, n_block,
                              warp_idx, mSem, blocks)

        self.store_dkdv(acc_dK, acc_dV, softmax_scale, st_atom, tiled_mma_dk, tiled_mma_dv, tidx,
                        sK, sV, mdK, mdV, tma_dK, tma_dV, kv_head, batch, n_block, warp_idx)
