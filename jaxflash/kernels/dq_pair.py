"""`BwdConfig.dq_pair`: two CTAs of a cluster add their dQ partials before L2 does.

Why: at hd 256 a backward step (64 keys x 64 queries, 5 GEMMs) sends 64 KB of float32 dQ
partial to L2 as a bulk reduce-add and reads 64 KB of Q and dO; per unit of tensor work that is
twice hd 128's traffic (128 keys per CTA there). Nsight Compute on the H200 (2026-12-02,
`benchmarks/results/ncu-bwd-h256-4k-dense-*`): L2 throughput 83% of peak, tensor pipes 50%
active, 402 M reduce sectors (hd 128 at the same shape: 56% / 68%, 201 M). So the wide kernel
waits on L2, and the reduce-adds are its largest share.

What: the CTAs of key blocks 2j and 2j+1 of one (head, batch) form a cluster of 2 and walk the
same query blocks in the same order (dense calls only: see `BwdConfig.check`). The step's dQ
tile is already split in two parts, part w written by consumer warpgroup w (`dq_flat`'s
fragment order, 32 KB each). CTA r adds part r of both CTAs and reduce-adds only that part:
- warpgroup 1 - r ("giver") stages its part in its own shared memory and arrives, release at
  cluster scope, on the peer's FULL barrier;
- warpgroup r ("taker") waits on its FULL barrier, reads the peer's part r through distributed
  shared memory (same thread, same offsets: both CTAs' warpgroup r wrote it), adds it to its own
  accumulator registers, arrives on the peer's EMPTY barrier (the peer may overwrite that part
  again), stages the sum and one of its threads issues the 32 KB bulk reduce.
So each CTA sends half the dQ bytes to L2. The giver waits on EMPTY before staging again, and
before the CTA exits (its shared memory must outlive the peer's reads).

No cycle: the taker of step i waits for the peer's giver of step i, which waits only for the
taker of step i - 1 and its own CTA's step i. A key block count that is odd gets one extra CTA
(grid x rounded up to even): its keys are all past the sequence, so every score is masked and
it adds zeros, while it still walks the pair's query blocks (the range of the pair's even
block: `range_block`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import nvvm as _nvvm

from jaxflash.kernels.dq_accum import BAR_DQ, bulk_reduce_add_f32

PAIR = 2
# The pair's two mbarriers, after the K / V pipeline's in `mbar_kv`: FULL (the peer's giver
# staged my part) and EMPTY (the peer's taker has read my giver's part).
PAIR_BARRIERS = 2
_FULL, _EMPTY = 0, 1


class DqPair:
    """Mixin of `FlashBwdSm90` (used by `FlashBwdSm90Wide`). Every method is a no-op (or the
    unpaired value) without ``cfg.dq_pair``, so the other variants' code is unchanged."""

    @property
    def pair_barriers(self) -> int:
        return PAIR_BARRIERS if self.cfg.dq_pair else 0

    def pair_grid_x(self, num_n_blocks):
        """Grid x: the key blocks, rounded up to whole pairs."""
        if const_expr(self.cfg.dq_pair):
            return (num_n_blocks + PAIR - 1) // PAIR * PAIR
        return num_n_blocks

    def pair_launch(self) -> dict:
        return {"cluster": [PAIR, 1, 1]} if self.cfg.dq_pair else {}

    def range_block(self, n_block):
        """The key block whose query-block range this CTA walks: the pair's even one."""
        if const_expr(self.cfg.dq_pair):
            return n_block - n_block % PAIR
        return n_block

    @cute.jit
    def pair_init(self, mbar_ptr):
        """Before the roles split: the pair's barriers (128 arrivals each: one per thread of
        the peer's warpgroup), kept on ``self`` for `consume` (trace-time state of this
        kernel's one trace, like the layouts)."""
        if const_expr(self.cfg.dq_pair):
            self.pair_mbar = mbar_ptr
            if cute.arch.warp_idx() == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(PAIR_BARRIERS):
                        cute.arch.mbarrier_init(mbar_ptr + i, 128)
            cute.arch.mbarrier_init_fence()

    def pair_init_wait(self):
        """Every barrier of both CTAs initialised before any thread goes on (a remote arrive
        on a peer's uninitialised barrier would be lost)."""
        if const_expr(self.cfg.dq_pair):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            pipeline.pipeline_init_wait()

    def dq_issuer_warp(self, n_block):
        """The warp that issues (and waits for) this CTA's dQ reduce-adds: warp 4 (the first
        consumer warp), or the taker warpgroup's first warp."""
        if const_expr(self.cfg.dq_pair):
            return 4 + 4 * (n_block % PAIR)
        return 4

    def _peer_arrive(self, which: int, peer):
        cute.arch.mbarrier_arrive(self.pair_mbar + which, peer_cta_rank_in_cluster=peer,
                                  scope=_nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def flush_dq_pair(self, mdQ, sdQ, tdQsdQ, acc_dQ, step: Int32, m_block: Int32, head: Int32,
                      batch: Int32, n_block: Int32, warp_idx: Int32):
        """This thread's share of the step's paired dQ flush (see the module docstring).
        acc_dQ complete; the previous reduce of this part has been read (the issuer warp
        waited before the step's _BAR_DS)."""
        rank = n_block % PAIR
        peer = 1 - rank
        wg = (warp_idx - 4) // 4
        if wg == rank:
            cute.arch.mbarrier_wait(self.pair_mbar + _FULL, step % 2)
            cute.arch.fence_acq_rel_cluster()  # acquire: the peer's staged part
            theirs = cute.make_tensor(cute.arch.map_dsmem_ptr(tdQsdQ.iterator, peer),
                                      tdQsdQ.layout)
            mine = cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape))
            got = cute.make_rmem_tensor_like(mine)
            cute.autovec_copy(theirs, got)
            mine.store(mine.load() + got.load())
            self._peer_arrive(_EMPTY, peer)  # release: my reads of its part are done
            self.stage_dq(acc_dQ, tdQsdQ)
            cute.arch.fence_view_async_shared()  # visible to the bulk copy unit
            cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
            if warp_idx == self.dq_issuer_warp(n_block):
                part = self.tile_m * self.hd // PAIR
                with cute.arch.elect_one():
                    dst = (mdQ.iterator + cute.crd2idx((batch, head, m_block, 0), mdQ.layout)
                           + rank * part)
                    bulk_reduce_add_f32(dst, sdQ.iterator + rank * part, part * 4)
                    cute.arch.cp_async_bulk_commit_group()
        else:
            if step > 0:
                cute.arch.mbarrier_wait(self.pair_mbar + _EMPTY, (step - 1) % 2)
            self.stage_dq(acc_dQ, tdQsdQ)
            self._peer_arrive(_FULL, peer)  # release: my part is staged

    @cute.jit
    def pair_drain(self, num_steps: Int32, n_block: Int32, warp_idx: Int32):
        """After the step loop: the giver waits for the peer's last read of its part, the
        issuer for its last reduce's read, so neither CTA's shared memory goes away early."""
        if const_expr(self.cfg.dq_pair):
            if num_steps > 0:
                wg = (warp_idx - 4) // 4
                if wg != n_block % PAIR:
                    cute.arch.mbarrier_wait(self.pair_mbar + _EMPTY, (num_steps - 1) % 2)
                if warp_idx == self.dq_issuer_warp(n_block):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
