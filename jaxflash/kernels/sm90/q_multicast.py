"""`BwdConfig.q_multicast`: key-block pairs share their Q / dO loads by TMA multicast.

Why: every CTA of the backward reads the Q and dO tiles of every query block it visits from
L2; at hd 256 (64 keys per CTA) that is 64 KB per 64 x 64 step beside the 64 KB dQ reduce-add,
and Nsight Compute puts the kernel at 83% of L2 peak with the tensor pipes half idle
(measured on the H200 at 4k dense, see docs/design.md). Two CTAs whose key blocks are
adjacent visit the same query blocks (dense: all of them; causal: the odd block's range is the
even block's minus its first block), so they can fetch each tile once.

What: key blocks 2j and 2j+1 of one (kv head, batch) form a cluster of two CTAs (grid x
rounded up to even: a phantom CTA past the last key block has every key masked and its dK / dV
rows clipped by the TMA store). Both walk the query-block range of block 2j in the same order,
so their pipelines move in step; for block 2j+1 the first block of that range under causal
masking is fully masked (`QueryBlockRange.needs_mask` is true there: P = dS = 0), a wasted step
instead of a second schedule. With `tail_lpt` the launch order is that of the pairs
(`bwd_order.block_coords(pair=2)`), so a cluster always holds two adjacent blocks. Per stage,
CTA r loads half of the Q tile and half of the dO tile (`cpasync.tma_partition` with the pair
as the CTA layout) and multicasts each half into both CTAs' shared memory, signalling each
CTA's FULL barrier of that stage (whose producer still arrives with the whole tile's byte
count). LSE / delta rows stay per-CTA loads (256 B each).

The stage can be refilled only when both CTAs' consumers are done with it: each consumer warp's
release arrives on the EMPTY barrier of both CTAs (`PipelineTmaAsync` with the pair as its
cluster layout: lanes 0 and 1 each signal one CTA), which then counts 2 x 8 warps. This couples
the pair's step times (as `dq_pair` did through its dQ exchange, which lost 20-25%); here there
is no per-step data exchange, only the shared load.

Exit: a CTA's shared memory and barriers must outlive the peer's remote arrivals and multicast
writes into them, so all threads end with a cluster barrier.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from jaxflash.kernels.common import layouts

PAIR = 2


class QMulticast:
    """Mixin of `FlashBwdSm90`: every method gives the unpaired behaviour (and the same
    generated code) without ``cfg.q_multicast``."""

    @property
    def paired(self) -> bool:
        return bool(self.cfg.q_multicast)

    @property
    def pair_size(self) -> int:
        """CTAs per cluster along the key blocks (1: no cluster)."""
        return PAIR if self.paired else 1

    def qdo_load_op(self):
        """(TMA op, multicast factor) of the Q and dO loads."""
        if self.paired:
            return cpasync.CopyBulkTensorTileG2SMulticastOp(), PAIR
        return cpasync.CopyBulkTensorTileG2SOp(), 1

    def pair_grid_x(self, num_n_blocks):
        """Grid x: the key blocks, rounded up to whole pairs."""
        if self.paired:
            return (num_n_blocks + PAIR - 1) // PAIR * PAIR
        return num_n_blocks

    def pair_launch(self) -> dict:
        return {"cluster": [PAIR, 1, 1]} if self.paired else {}

    def cluster_shape(self):
        """The cluster as `pipeline_init_arrive` / `_wait` take it (None: no cluster)."""
        return cute.make_layout((PAIR, 1)) if self.paired else None

    def range_block(self, n_block):
        """The key block whose query-block range this CTA walks: the pair's even one."""
        if self.paired:
            return n_block - n_block % PAIR
        return n_block

    def qdo_pipeline_layout(self):
        """Cluster layout (v, m, n, k) of the Q / dO pipelines: consumers release the stage
        in both CTAs of the pair (None: this CTA only)."""
        return cute.make_layout((1, PAIR, 1, 1)) if self.paired else None

    def qdo_tiles(self, atom, smem: cute.Tensor, gmem: cute.Tensor):
        """(smem, gmem) views of this CTA's share of a Q or dO tile load: the whole tile, or
        with multicast the half that CTA rank r issues for both."""
        if self.paired:
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            return cpasync.tma_partition(atom, rank, cute.make_layout(PAIR),
                                         cute.group_modes(smem, 0, 2),
                                         cute.group_modes(gmem, 0, 2))
        return layouts.tma_tiles(atom, smem, gmem)

    def qdo_load_order(self, q_load, do_load):
        """The producer's per-step order of the Q (+ LSE) and dO (+ delta) loads: the order in
        which the consumers first wait for them."""
        return q_load, do_load

    def qdo_copy_kw(self) -> dict:
        """Extra `cute.copy` arguments of the Q / dO loads: both CTAs receive each half."""
        return {"mcast_mask": cutlass.Int16((1 << PAIR) - 1)} if self.paired else {}

    def pair_exit(self):
        """All threads: no CTA leaves while its peer may still signal or fill it."""
        if self.paired:
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
