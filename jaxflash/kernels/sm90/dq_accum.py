"""How a backward step's dQ partial reaches the float32 dQ accumulator in global memory (other
CTAs add to the same rows): staged in shared memory and added by one TMA reduce-add, or with
``dq_flat`` by one flat bulk reduce of the fragment-ordered tile; with ``deterministic``, the
reduce-adds into a query block take turns in key block order through a semaphore per (batch,
head, query block) (`common.dq_order`, shared with the Blackwell backward; see `sm90.bwd`'s
docstring). Shared by both Hopper backward kernels
(`FlashBwdSm90`, `FlashBwdSm90Wide`).
"""
from __future__ import annotations

from typing import Optional

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.dq_order import pass_turn, wait_turn
from jaxflash.kernels.common.mask import QueryBlockRange

# Named barrier id (the kernels' others are in `sm90.bwd`): the step's dQ tile is in shared
# memory, the reduce may read it.
BAR_DQ = 3


class DqAccumulation:
    """Mixin of `FlashBwdSm90` (and so `FlashBwdSm90Wide`): the dQ staging layouts and the
    flush. Reads the kernel's ``tile_m``, ``hd``, ``dq_flat``, ``num_mma_wg``,
    ``num_mma_threads`` and ``cfg``."""

    def dq_flat_layout(self):
        """`dq_flat`'s staging tile: tile_m x hd floats in fragment order, one part per
        warpgroup ([part size, warpgroups]; identity swizzle, so both kernels allocate and
        view it like the others)."""
        part = self.tile_m * self.hd // self.num_mma_wg
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0,
                                         cute.make_layout((part, self.num_mma_wg)))

    def dq_flat_partition(self, sdQ, tidx):
        """A consumer thread's view of the `dq_flat` staging tile for 16-byte stores: chunk c
        of thread t of warpgroup w at w * part + (128 c + t) * 4 (`bwd_launch.dq_from_flat`
        undoes this order); one warp's store is 512 contiguous bytes, so no bank conflicts.
        Plain Python (inlined while `consume` is traced)."""
        r2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout((128, self.num_mma_wg)), cute.make_layout(4))
        flat = cute.make_tensor(sdQ.iterator, self.dq_flat_layout().outer)
        return r2s.get_slice(tidx).partition_D(flat)

    def stage_dq(self, acc_dQ, tdQsdQ):
        """The thread's dQ accumulator into its part of the staging tile: register order for
        `dq_flat` (`dq_flat_partition`), else the MMA's C partition. Plain Python (inlined)."""
        if const_expr(self.dq_flat):
            cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)),
                              tdQsdQ)
        else:
            tdQsdQ.store(acc_dQ.load())

    @cute.jit
    def flush_dq(self, mdQ, sdQ, tdQsdQ, tma_dQ, acc_dQ, m_block: Int32, head: Int32,
                 batch: Int32, n_block: Int32, warp_idx: Int32, mSem: Optional[cute.Tensor],
                 blocks: QueryBlockRange):
        """Add one step's dQ partial (acc_dQ, complete) to the float32 accumulator in global
        memory: through sdQ and TMA reduce-adds (with `dq_flat` one bulk reduce) issued by
        warp 4. sdQ must be free: warp 4 waited for the previous reduce's reads before the
        last _BAR_DS that every consumer thread passed since."""
        self.stage_dq(acc_dQ, tdQsdQ)
        cute.arch.fence_view_async_shared()  # visible to the TMA / bulk copy unit
        cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=self.num_mma_threads)
        if warp_idx == 4:
            sem = None
            if const_expr(self.dq_flat):
                # Fragment order: one bulk reduce of the whole tile into its block of the
                # fragment-ordered accumulator.
                if const_expr(self.cfg.deterministic):
                    sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
                    wait_turn(sem, n_block - blocks.n_block_first(m_block))
                with cute.arch.elect_one():
                    dst = mdQ.iterator + cute.crd2idx((batch, head, m_block, 0), mdQ.layout)
                    bulk_reduce_add_f32(dst, sdQ.iterator, self.tile_m * self.hd * 4)
                    cute.arch.cp_async_bulk_commit_group()
            else:
                gdQ = cute.local_tile(mdQ[None, None, head, batch], (self.tile_m, self.hd),
                                      (m_block, 0))
                tQs, tQg = layouts.tma_tiles(tma_dQ, sdQ, gdQ)
                if const_expr(self.cfg.deterministic):
                    sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
                    wait_turn(sem, n_block - blocks.n_block_first(m_block))
                cute.copy(tma_dQ, tQs, tQg)  # reduce-add into global (rows past T are
                cute.arch.cp_async_bulk_commit_group()  # clipped by the TMA unit)
            if const_expr(self.cfg.deterministic):
                pass_turn(sem)


@dsl_user_op
def bulk_reduce_add_f32(dst: cute.Pointer, src: cute.Pointer, size: int, *, loc=None,
                        ip=None):
    """dst[i] += src[i] over `size` bytes (global float32 <- shared float32), one
    cp.reduce.async.bulk in the calling thread's bulk group (commit / wait as for TMA). The
    DSL wraps only the tensor (TMA) form of this PTX instruction, hence the inline asm."""
    llvm.inline_asm(
        None, [dst.llvm_ptr, src.toint(loc=loc, ip=ip).ir_value(), Int32(size).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
