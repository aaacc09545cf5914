"""The forward kernel's output epilogue: normalized O from registers to shared memory
(stmatrix) and out with TMA stores. Mixin of `FlashFwdSm90` (reads ``o_dtype``, ``hdv``,
``separate_o``, ``wg_epilogue``, ``num_mma_threads``); split from `sm90.fwd` to keep that
module to the kernel's structure.

Two forms: the whole tile by warp 4 after 256-thread barriers (O in Q's buffer or its own),
or, with ``wg_epilogue``, each warpgroup's 64 rows by that warpgroup's first warp after its
own 128-thread barriers, so a warpgroup never waits for the other at a tile's end.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.softmax import rescale_rows

# Named barrier ids (`sm90.fwd` has the others: 0 is __syncthreads, 2 / 3 the pingpong pair).
BAR_EPILOGUE = 1
BAR_EPILOGUE_WG = 4  # 4 + consumer warpgroup index (`wg_epilogue`)


class FwdEpilogue:
    @cute.jit
    def finish_tile(self, c, mO, mLSE, sO, tma_O, pipe_q, q_state, tiled_mma_pv, tidx: Int32,
                    warp_idx: Int32, blocks, m_block: Int32, head: Int32, batch: Int32,
                    seqlen_q: Int32, T: Int32):
        """A tile's epilogue: O scaled by 1 / rowsum, LSE written, O stored (`store_o`). ``c``
        is the consumer's fragments (`sm90.fwd._ConsumerCtx`)."""
        num_rows = c.num_rows
        tOcO = c.tOcO
        lse = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        inv = c.softmax.finalize(lse)
        if const_expr(self.cfg.has_q_seqlen):
            # Rows past the query length: output 0 and LSE -inf (they attend to nothing).
            for r in cutlass.range_constexpr(num_rows):
                if m_block * self.tile_m + tOcO.row(r) >= seqlen_q:
                    inv[r] = Float32(0.0)
                    lse[r] = -Float32.inf
        rescale_rows(c.acc_O, self.output_scale(c, inv))

        if tOcO.base_col == 0:  # the thread holding column 0 of its rows writes LSE
            for r in cutlass.range_constexpr(num_rows):
                row = blocks.first_row(m_block) + tOcO.row(r)
                if row < T:
                    mLSE[row, head, batch] = lse[r]

        self.store_o(c.acc_O, mO, sO, tma_O, pipe_q, q_state, tiled_mma_pv, tidx, warp_idx,
                     c.wg, blocks, m_block, head, batch)

    def output_scale(self, c, inv):
        """Per-row factor applied to O at the end: 1 / rowsum here (the FP8 subclass folds in
        V's descale). Plain Python (inlined while tracing)."""
        return inv

    @cute.jit
    def store_o(self, acc_O, mO, sO, tma_O, pipe_q, q_state, tiled_mma_pv, tidx: Int32,
                warp_idx: Int32, wg: Int32, blocks, m_block: Int32, head: Int32, batch: Int32):
        """O (already normalized, float32 registers) of tile m_block to global memory; without
        a separate O buffer also hands Q's buffer back (O reuses it)."""
        rO = cute.make_rmem_tensor_like(acc_O, self.o_dtype)
        rO.store(acc_O.load().to(self.o_dtype))
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.o_dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        if const_expr(self.wg_epilogue):
            # This warpgroup's rows only: its first warp issued (and waits for) its stores.
            first = warp_idx == 4 + 4 * wg
            if first:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # previous tile's rows read
            cute.arch.barrier(barrier_id=BAR_EPILOGUE_WG + wg, number_of_threads=128)
            cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))
            cute.arch.fence_view_async_shared()  # make the smem writes visible to the TMA unit
            cute.arch.barrier(barrier_id=BAR_EPILOGUE_WG + wg, number_of_threads=128)
            gO = blocks.row_box(mO[None, None, head, batch], m_block, self.hdv)
            tOsO, tOgO = layouts.tma_tiles(tma_O, cute.local_tile(sO, (64, self.hdv), (wg, 0)),
                                           cute.local_tile(gO, (64, self.hdv), (wg, 0)))
            if first:
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
        else:
            self.store_o_whole(mO, sO, tma_O, pipe_q, q_state, warp_idx, blocks, m_block, head,
                               batch, st_atom, thr_st, rO)

    @cute.jit
    def store_o_whole(self, mO, sO, tma_O, pipe_q, q_state, warp_idx: Int32, blocks,
                      m_block: Int32, head: Int32, batch: Int32, st_atom, thr_st, rO):
        """The whole tile's O in one store by warp 4, after both warpgroups' rows are in sO."""
        if const_expr(self.separate_o):
            # The previous tile's TMA store must have finished reading sO.
            if warp_idx == 4:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        # (Aliased with Q: each warpgroup overwrites only the Q rows its own finished GEMMs read.)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))
        cute.arch.fence_view_async_shared()  # make the smem writes visible to the TMA unit
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        gO = blocks.row_box(mO[None, None, head, batch], m_block, self.hdv)
        tOsO, tOgO = layouts.tma_tiles(tma_O, sO, gO)
        if warp_idx == 4:
            cute.copy(tma_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.separate_o):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(not self.separate_o):
            # O's buffer is Q's: hand it back only once the store has read it.
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
            pipe_q.consumer_release(q_state)
