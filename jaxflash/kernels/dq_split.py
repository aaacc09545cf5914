"""`BwdConfig.dq_split`: a `q_multicast` pair splits each step's dQ tile by columns.

Why: at hd 256 every CTA of the backward reduce-adds a 64 x 256 float32 dQ tile (64 KB) into
L2 per 64 x 64 step; with `q_multicast` halving the Q / dO reads that is the larger share of
the step's L2 traffic (Nsight Compute: L2 at 83% of peak, tensor pipes half idle; q_multicast
alone: 4k dense 5% faster). The two CTAs of a pair (key blocks 2j, 2j + 1) visit the same
query block in the same step, so their two dQ partials can be summed before they reach L2.
`dq_pair` (2026-12-02, removed) summed them by reading the peer's float32 partial through
DSMEM per step and lost 20-25%: 32 KB of DSMEM reads and an add on the critical path.

What: CTA r computes the column half r of the pair's sum itself,

    dQ[:, 128 r : 128 r + 128] = dS_own K_own[:, half r] + dS_peer K_peer[:, half r]

(one wgmma group each, K = 64 keys; each warpgroup 64 of the 128 columns), so it needs the
peer's dS^T of the step (64 x 64 bf16, 8 KB) and the peer's K half (loaded once by TMA beside
K and V). After both warpgroups have stored their dS^T (the step's dS barrier), warp 4 copies
it into the peer with one `cp.async.bulk.shared::cluster` that completes the peer's FULL
mbarrier of that buffer; the peer issues its own dS K group first and waits for FULL only
before the second group, so the copy runs under the dV, dK and own-dQ GEMMs. Once the second
group is done each consumer warp arrives on the sender's EMPTY mbarrier of the buffer, and the
sender waits for that before it overwrites its own dS^T buffer (two buffers: P^T / dS^T are
double-buffered, as with dq_wg_flush). Each CTA then stages and bulk-reduces half the tile:
half the reduce bytes and half the staging stores per CTA, for 8 KB of DSMEM writes per step.

The flat dQ accumulator block holds four parts (CTA rank, warpgroup) of 64 x 64 in fragment
order (`bwd_launch.dq_from_flat`). Exit needs nothing new: `q_multicast`'s closing cluster
barrier comes after every remote arrive and every copy into a CTA has been waited for.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import dsl_user_op

from jaxflash.kernels import layouts

PARTS = 4  # dQ parts of a flat block: (CTA rank, warpgroup)
_FULL, _EMPTY = 0, 2  # mbarrier indices: FULL[b] = _FULL + b, EMPTY[b] = _EMPTY + b


class DqSplit:
    """Mixin of `FlashBwdSm90` (used by the wide kernel): without ``cfg.dq_split`` nothing
    here is traced, so the other variants' code is unchanged."""

    @property
    def dq_split(self) -> bool:
        return bool(self.cfg.dq_split)

    def dq_flat_parts(self) -> int:
        """Parts of a flat dQ block (one per warpgroup, or per (rank, warpgroup))."""
        return PARTS if self.dq_split else self.num_mma_wg

    def dq_tile_cols(self) -> int:
        """Columns of the dQ tile this CTA computes per step."""
        return self.hd // 2 if self.dq_split else self.hd

    def peer_k_layout(self):
        """The peer's K half [tile_n, hd / 2], read as the second dQ group's B operand."""
        return layouts.smem_layout(self.dtype, self.tile_n, self.hd // 2)

    def peer_ds_layout(self):
        """Two buffers of the peer's dS^T, laid out as this CTA's (the copy is bytewise)."""
        return layouts.smem_layout(self.dtype, self.tile_n, self.tile_m, 2)

    def peer_k_bytes(self) -> int:
        return self.tile_n * self.hd // 2 * 2 if self.dq_split else 0

    @cute.jit
    def init_split_barriers(self, mbar, warp_idx: Int32):
        """FULL[b]: one local arrival (with the copy's byte count) + the copy's bytes; EMPTY[b]:
        the peer's 8 consumer warps. Before the cluster's init sync (`TmaPipelines.init_done`)."""
        if warp_idx == 0:
            with cute.arch.elect_one():
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(mbar + _FULL + b, 1)
                    cute.arch.mbarrier_init(mbar + _EMPTY + b, self.num_mma_threads // 32)
            cute.arch.mbarrier_init_fence()

    def split_rank(self, n_block):
        """This CTA's rank in the pair (= its cluster rank: clusters are key blocks 2j, 2j + 1,
        also under tail_lpt, `bwd_order.block_coords`)."""
        return n_block % 2

    def split_operands(self, wg_dq, sK, sKp, sdSp, n_block):
        """(own K half, peer dS, peer K half) operand fragments of the dQ groups."""
        own_k = cute.local_tile(sK, (self.tile_n, self.hd // 2), (0, self.split_rank(n_block)))
        tKo = wg_dq.make_fragment_B(wg_dq.partition_B(layouts.transpose_mn(own_k)))
        tdSp = wg_dq.make_fragment_A(wg_dq.partition_A(layouts.transpose_mn(sdSp)))
        tKp = wg_dq.make_fragment_B(wg_dq.partition_B(layouts.transpose_mn(sKp)))
        return tKo, tdSp, tKp

    @cute.jit
    def wait_ds_free(self, mbar, step: Int32):
        """All consumer threads, before storing this step's P^T / dS^T into buffer step % 2:
        the peer is done with what was sent from it two steps ago (free at steps 0 and 1)."""
        b = step % 2
        cute.arch.mbarrier_wait(mbar + _EMPTY + b, 1 - (step // 2) % 2)

    @cute.jit
    def send_ds(self, mbar, sdS_own, sdSp, n_block: Int32, step: Int32, warp_idx: Int32):
        """Warp 4, after the step's dS barrier: expect the peer's dS^T of this step into
        FULL[b] here, and copy this CTA's dS^T (buffer b) into the peer's buffer b."""
        b = step % 2
        if warp_idx == 4:
            with cute.arch.elect_one():
                nbytes = self.tile_n * self.tile_m * 2
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + _FULL + b, nbytes)
                peer = 1 - self.split_rank(n_block)
                src = sdS_own[None, None, 2 * b + 1].iterator
                dst = sdSp[None, None, b].iterator
                bulk_copy_to_peer(dst, src, mbar + _FULL + b, peer, nbytes)

    @cute.jit
    def wait_peer_ds(self, mbar, step: Int32):
        """All consumer threads, before the second dQ group: the peer's dS^T has landed."""
        cute.arch.mbarrier_wait(mbar + _FULL + step % 2, (step // 2) % 2)

    @cute.jit
    def release_peer_ds(self, mbar, n_block: Int32, step: Int32):
        """Each consumer warp once its second dQ group is done: buffer step % 2 of the peer
        (its dS^T, and this CTA's copy of it) may be overwritten."""
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(mbar + _EMPTY + step % 2,
                                      peer_cta_rank_in_cluster=1 - self.split_rank(n_block),
                                      scope=nvvm.MemScopeKind.CLUSTER)

    def split_dq_offset(self, n_block):
        """Float offset of this CTA's half in a flat dQ block (parts (rank, warpgroup))."""
        if const_expr(self.dq_split):
            return self.split_rank(n_block) * (self.tile_m * self.hd // 2)
        return 0


@dsl_user_op
def bulk_copy_to_peer(dst: cute.Pointer, src: cute.Pointer, mbar: cute.Pointer, peer: Int32,
                      size: int, *, loc=None, ip=None):
    """Copy `size` bytes of this CTA's shared memory at `src` to the same-offset buffer `dst`
    of CTA `peer` of the cluster, completing `size` bytes on the peer's mbarrier at `mbar`'s
    offset (`cp.async.bulk.shared::cluster.shared::cta`; the DSL wraps only its experimental
    form, hence the inline asm, as for `dq_accum.bulk_reduce_add_f32`)."""
    llvm.inline_asm(
        None,
        [dst.toint(loc=loc, ip=ip).ir_value(), src.toint(loc=loc, ip=ip).ir_value(),
         mbar.toint(loc=loc, ip=ip).ir_value(), Int32(peer).ir_value(loc=loc, ip=ip),
         Int32(size).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 d, m;\n"
        "mapa.shared::cluster.u32 d, $0, $3;\n"
        "mapa.shared::cluster.u32 m, $2, $3;\n"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
        " [d], [$1], $4, [m];\n"
        "}",
        "r,r,r,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
