"""The hd 128 dense backward with 80 queries per step: `FlashBwdSm90M80` (opt-in, gated).

FlashAttention-3 runs its hd 128 non-causal backward with 80-query steps (64 causal). Fewer,
fatter steps amortize what every step pays once whatever its size: the two named barriers,
the LSE / delta loads and the dQ flush (store, fence, reduce-add). 80 is no wgmma M atom, so
the GEMMs whose M would be the queries are arranged to have the queries as N (a multiple of
8) or K (a multiple of 16) instead; everything else is `hopper_bwd.FlashBwdSm90` unchanged
(one CTA per 128-key block, 2 consumer warpgroups of 64 keys, producer warp, dK / dV in
registers, the same launch interface):

    S^T  = K Q^T, dP^T = V dO^T    M = 64 keys per warpgroup, N = 80 queries, K = 128 (SS)
    dV  += P^T dO, dK += dS^T Q    M = 64 keys, N = 128, K = 80: 5 k-blocks of 16 (RS)
    dQ^T = K^T dS^T                M = head dim (64 per warpgroup), N = 80 queries, K = 128
                                   keys; A = K^T (sK's MN-major view), B = dS^T (smem)

The dQ^T accumulator is [hd, query]-shaped (40 floats per thread); the global dQ accumulator
and its TMA reduce-add box stay [query, hd] (hd contiguous, which a TMA box cannot transpose),
so each thread stores its fragment through the transposed view of the staging tile. That
tile is laid out as unswizzled 8-column slabs (80 rows x 32 B each, as tile_m 128 does:
`FlashBwdSm90.__init__`), so a thread's 40 scalar stores are one base address plus
immediates (no XOR'd addresses kept live across the loop), and the reduce-add takes 16
boxes of 80 x 8 floats.

Shared memory (`BwdConfig.smem_bytes`): K + V 64 KB, Q + dO 2 stages x 80 x 128 x 2 x 2 =
80 KB, dS^T 2 buffers x 128 x 80 x 2 = 40 KB (80 columns of 160 B: 32B swizzle atoms of 16
columns), float32 dQ tile 40 KB, LSE / delta 1.5 KB (2 stages of 80 rows, 96 apart: a TMA
destination must be 128 B aligned): 231,936 of 232,448 bytes with 1 KB for barriers and
alignment. LSE / delta are padded to a multiple of 320 (lcm(64, 80):
`bwd_launch.padded_len`).

Registers: S^T + dP^T 40 + 40 and dK + dV 64 + 64 = 208 accumulator floats per consumer
thread (192 at tile_m 64); the dQ^T accumulator (40) lives only after S^T / dP^T are dead.
Dense only (`BwdConfig.check` refuses every mask, length, bias, the deterministic and "red"
dQ modes and the schedule variants), gated in `verified.RULES` until its device checks pass.
"""
from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.sm90.bwd import FlashBwdSm90
from jaxflash.kernels.common.mask import TileCoords


class FlashBwdSm90M80(FlashBwdSm90):
    """`FlashBwdSm90` with 80-query steps and a transposed dQ GEMM (``tile_m`` 80)."""

    def __init__(self, config: BwdConfig):
        super().__init__(config)
        if config.tile_m != 80 or config.split != "keys":
            raise ValueError(f"FlashBwdSm90M80 serves tile_m 80 (hd 128), got {config.key}")
        # dQ^T: the warpgroups split the head dim (M), each with all 80 queries (N).
        self.dq_transposed = True
        self.dq_atoms = (self.num_mma_wg, 1, 1)
        self.dq_cols = self.hd // self.num_mma_wg  # head-dim rows of dQ^T per warpgroup
        # Staging tile: 8-column slabs (see the module docstring); sK keeps 64-column 128B
        # atoms (`smem_layouts` reads dq_cols), whole ones per warpgroup's A slice.
        self.dq_swizzle = False
        self.dq_atom_cols = 8
        # No accumulator zeroing (`FlashBwdSm90.clear_acc`): measured with ptxas, it changed
        # nothing here (the spills it fixes elsewhere came from the elementwise phase here).
        self.clear_acc = False

    def tiled_mmas(self):
        K_, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        sdp, dk, dv, _ = super().tiled_mmas()  # S^T / dP^T (n80), dK / dV (k80): unchanged
        # dQ^T = K^T dS^T: A = K^T (hd rows contiguous in sK: MN-major), B = dS^T viewed as
        # [query, key] (queries contiguous in sdS: MN-major); M = hd split over the warpgroups.
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32, atom_layout_mnk=self.dq_atoms,
            tiler_mn=(64, self.tile_m))
        return sdp, dk, dv, tiled_mma_dq

    def dq_operands(self, wg_dq, sdS, sK):
        tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(layouts.transpose_mn(sK)))
        tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(layouts.transpose_mn(sdS)))
        return tdQrKt, tdQrdS

    def dq_gemm(self, tiled_mma_dq, acc_dQ, dq_ops, buf, wait: int, clear: bool):
        """acc_dQ (= dQ^T) = K^T dS^T from dS^T buffer `buf`."""
        tdQrKt, tdQrdS = dq_ops
        layouts.wgmma(tiled_mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, buf],
                      zero_init=True, wait=wait, clear=clear)

    def probs_and_grads_lowp(self, acc_S, acc_dP, coords: TileCoords, sLSE, sDelta,
                             stage: Int32, scale_log2: Float32):
        """P^T and dS^T (the base's arithmetic, same order of operations per element), each
        8-column group converted to the input dtype as soon as it is done. With the base
        version (every element first, then both whole conversions) ptxas spilled 8 bytes here
        (2026-12-01): S^T and dP^T (80 floats), dK / dV (128) and the 20 + 20 LSE / delta
        values it hoists leave no room; converting per group lets a group's float P^T / dS^T
        die at once (0 bytes, R237 the highest register)."""
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        t0 = coords.t0
        # acc ((2 columns, 2 rows, V column groups of 8), 1, 1): flat i = c + 2 r + 4 v.
        for v in range(cute.size(acc_S, mode=[0, 2])):
            for c in range(2):
                col = coords.base_col + t0[0, c + 2 * v][1]
                lse2 = sLSE[col, stage]
                delta = sDelta[col, stage]
                for r in range(2):
                    i = c + 2 * r + 4 * v
                    p = cute.math.exp2(acc_S[i] * scale_log2 - lse2, fastmath=True)
                    acc_dP[i] = p * (acc_dP[i] - delta)
                    acc_S[i] = p
            g = ((None, None, v), None, None)
            rP[g].store(acc_S[g].load().to(self.dtype))
            rdS[g].store(acc_dP[g].load().to(self.dtype))
        return rP, rdS
