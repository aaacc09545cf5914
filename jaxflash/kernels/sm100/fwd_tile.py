"""The Blackwell forward's tile facts, built inside each warp role: `tile_range` (the CTA's
lengths, window and key-block range) and `segment_mask` (segment ids through shared memory).

Both exist to keep registers down. `tile_range` is called by every role after its
`setmaxnreg`: computed once before the split, the window, lengths and block ranges stayed live
into the 104-register MMA / load warps, and ptxas spilled. `segment_mask` is
`mask.apply_segment_mask` with the key block's ids staged in shared memory.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.mask import BlockRange, SegmentRows, TileCoords


class Tile:
    """One CTA's tile (query block, head, K/V head, batch), its lengths and its key-block range
    [n_min, n_max) (``count`` blocks)."""

    def __init__(self, m_block, head, kv_head, batch, n_min, n_max, seqlen_q, seqlen_k,
                 blocks: BlockRange):
        self.m_block, self.head, self.kv_head, self.batch = m_block, head, kv_head, batch
        self.n_min, self.n_max, self.count = n_min, n_max, cutlass.max(n_max - n_min, 0)
        self.seqlen_q, self.seqlen_k, self.blocks = seqlen_q, seqlen_k, blocks


@cute.jit
def tile_range(cfg: cutlass.Constexpr, tile_m: cutlass.Constexpr, m_block: Int32, head: Int32,
               batch: Int32, mQ, mK, mQSeqlen, mKVSeqlen, mQBlk, mIScalars):
    """This CTA's `Tile` (the Hopper kernel's rules) at (m_block, head, batch)."""
    window_left = Int32(0)
    window_right = Int32(0)
    if const_expr(cfg.has_window):
        window_left = mIScalars[0]
        window_right = mIScalars[1]
        if const_expr(cfg.is_causal):
            window_right = cutlass.min(window_right, Int32(0))
    blocks = BlockRange(tile_m, cfg.tile_n, cfg.is_causal or cfg.has_window, cfg.has_window,
                        window_left, window_right)
    T, S = mQ.shape[0], mK.shape[0]
    seqlen_q = T
    if const_expr(mQSeqlen is not None):
        seqlen_q = cutlass.max(cutlass.min(T, mQSeqlen[batch]), 0)
    seqlen_k = S
    if const_expr(mKVSeqlen is not None):
        seqlen_k = cutlass.max(cutlass.min(S, mKVSeqlen[batch]), 0)
    n_min, n_max = blocks.n_block_min_max(m_block, seqlen_q, seqlen_k)
    if const_expr(mQBlk is not None):
        n_min = cutlass.max(n_min, mQBlk[batch, m_block, 2])
        n_max = cutlass.min(n_max, mQBlk[batch, m_block, 3])
    if blocks.first_row(m_block) >= seqlen_q:
        n_max = n_min
    return Tile(m_block, head, head // (mQ.shape[2] // mK.shape[2]), batch, n_min, n_max,
                seqlen_q, seqlen_k, blocks)


@cute.jit
def segment_mask(s: cute.Tensor, coords: TileCoords, rows: SegmentRows, sSeg: cute.Tensor,
                 seg_id: Int32, tile_n: cutlass.Constexpr, num_threads: cutlass.Constexpr,
                 barrier_id: cutlass.Constexpr):
    """Set s[i, j] to -inf where the row's segment differs from key j's, for one softmax
    thread per row (its whole row of tile_n scores in registers).

    ``seg_id`` is the id of key ``base_row`` of the block (read from global memory before the
    wait for S); each thread stores its one into ``sSeg`` (tile_n ids of this block's buffer),
    and after a barrier of the ``num_threads`` softmax threads reads the row back (broadcast
    loads at constant offsets, vectorized). Read per element from global memory instead, ptxas
    hoists the tile_n loads and their 64-bit addresses beside the row of scores and spills.
    The caller's condition must be uniform over the threads (all meet the barrier), and the
    buffer must not be rewritten until every thread has read it (`FlashFwdSm100.step`).
    """
    if coords.base_row < tile_n:
        sSeg[coords.base_row] = seg_id
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    s = layouts.acc_as_rows_cols(s)
    t0 = coords.t0
    for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
        cseg = sSeg[coords.base_col + t0[0, j][1]]
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            if cseg != rows.seg[r]:
                s[r, j] = -Float32.inf
