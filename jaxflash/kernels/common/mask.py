"""Tile masking and block ranges for the attention kernels (jax.nn semantics: top-left aligned).

Key j is visible to query i iff ``j < seqlen_k`` and, with a causal mask, ``j <= i``, and with a
window (left, right), ``i - left <= j <= i + right``. Causal and a window combine as a window with
``right = min(right, 0)``. A CTA tile covers rows [m0, m0 + tile_m) and key blocks are visited
right to left; this module says which blocks a tile needs at all (block skipping) and which of
those need an element mask (the rest run unmasked).

All bounds are runtime Int32 (window sizes never force a recompile); which bounds exist is static.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Float32

from jaxflash.kernels.common.carry import Carried
from jaxflash.kernels.common.layouts import acc_as_rows_cols


class BlockRange(Carried):
    """Which key blocks a query tile visits, and where masking is needed.

    has_right: a right bound exists (causal or window); has_left: a left bound exists (window).
    window_right must already be min(right, 0) when causal.
    """

    _dynamic = ("window_left", "window_right")

    def __init__(self, tile_m: int, tile_n: int, has_right: bool, has_left: bool,
                 window_left: Int32, window_right: Int32):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.has_right = has_right
        self.has_left = has_left
        self.window_left = window_left
        self.window_right = window_right

    def first_row(self, m_block: Int32):
        """The tile's first row."""
        return m_block * self.tile_m

    def end_row(self, m_block: Int32):
        """One past the tile's last row (may pass T; callers clip)."""
        return (m_block + 1) * self.tile_m

    def row_box(self, t: cute.Tensor, m_block: Int32, cols: int):
        """Tile m_block's (tile_m, cols) box of a (T, cols) TMA coordinate tensor (Q load, O
        store)."""
        return cute.local_tile(t, (self.tile_m, cols), (m_block, 0))

    @cute.jit
    def n_block_min_max(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[n_min, n_max) of key blocks holding any key visible to some row of the tile."""
        n_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        if cutlass.const_expr(self.has_right):
            last_row = cutlass.min(self.end_row(m_block), seqlen_q) - 1
            # columns <= last_row + right are visible; a negative bound means no block.
            lim = cutlass.max(last_row + self.window_right + 1, 0)
            n_max = cutlass.min(n_max, (lim + self.tile_n - 1) // self.tile_n)
        n_min = Int32(0)
        if cutlass.const_expr(self.has_left):
            first_col = cutlass.max(self.first_row(m_block) - self.window_left, 0)
            n_min = first_col // self.tile_n
        return n_min, n_max

    @cute.jit
    def n_block_min_right_mask(self, m_block: Int32, n_min: Int32):
        """Blocks >= this need the right (causal/window) mask; below it they are fully left
        of every row's right bound."""
        r = n_min
        if cutlass.const_expr(self.has_right):
            first_row = self.first_row(m_block)
            lim = cutlass.max(first_row + self.window_right + 1, 0)
            r = cutlass.max(n_min, lim // self.tile_n)
        return r

    @cute.jit
    def n_block_min_no_left_mask(self, m_block: Int32, n_min: Int32):
        """Blocks >= this are fully right of every row's left bound (no left mask needed)."""
        r = n_min
        if cutlass.const_expr(self.has_left):
            last_row = self.end_row(m_block) - 1
            need = cutlass.max(last_row - self.window_left, 0)
            r = cutlass.max(n_min, (need + self.tile_n - 1) // self.tile_n)
        return r


class TileCoords(Carried):
    """Where a thread's accumulator registers sit in the tile, cheaply.

    A register's (row, col) is the thread's base coordinate (runtime, 2 registers) plus a
    compile-time offset read from thread 0's partition (``t0``, all constants). Keeping the full
    per-register coordinate tensor live instead costs dozens of registers across the mainloop,
    enough to make ptxas serialize the wgmma (measured: causal hdim 128 at 0.65x of dense).
    """

    _dynamic = ("base_row", "base_col")

    def __init__(self, base_row: Int32, base_col: Int32, t0: cute.Tensor):
        self.base_row = base_row
        self.base_col = base_col
        self.t0 = t0

    @staticmethod
    def make(tiled_mma, tidx, shape):
        ident = cute.make_identity_tensor(shape)
        mine = tiled_mma.get_slice(tidx).partition_C(ident)
        t0 = acc_as_rows_cols(tiled_mma.get_slice(0).partition_C(ident))
        base = mine[0]
        return TileCoords(base[0], base[1], t0)

    def row(self, r: int):
        """Row (inside the tile) of the thread's r-th accumulator row."""
        return self.base_row + self.t0[r, 0][0]


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: TileCoords, m_block: Int32, n_block: Int32,
               tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               seqlen_k: Int32, window_left: Int32, window_right: Int32,
               mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
               mask_left: cutlass.Constexpr[bool], by_select: cutlass.Constexpr[bool] = False,
               skip_full: cutlass.Constexpr[bool] = False):
    """Set invisible scores of one (tile_m x tile_n) block to -inf.

    The tile's first row is ``m_block * tile_m``. Columns are compared as compile-time offsets
    against per-row limits shifted by the thread's base column, so the inner loop is one
    compare + select per register.

    by_select: write every register through one select instead of a conditional store. The
    conditional stores (one runtime ``if`` each) reach PTX as a cascade of selects that re-pick
    the row's earlier registers again at every column (about 16x the selects, with their
    temporaries live at once): at 160 registers per thread (tile_m 192 with intra-warpgroup
    overlap) that cascade alone spilled.
    skip_full: when only the key length masks (no right / left bound), compare nothing unless
    the block reaches past it: one warp-uniform test instead of one compare per score
    (`FwdConfig.mask_skip`).
    """
    if cutlass.const_expr(skip_full and mask_seqlen and not (mask_right or mask_left)):
        if (n_block + 1) * tile_n > seqlen_k:
            apply_mask(acc_s, coords, m_block, n_block, tile_m, tile_n, seqlen_k, window_left,
                       window_right, True, False, False, by_select)
        return
    s = acc_as_rows_cols(acc_s)
    t0 = coords.t0
    col0 = n_block * tile_n + coords.base_col
    row_start = m_block * tile_m
    if cutlass.const_expr(by_select):
        _mask_by_select(s, t0, row_start + coords.base_row - col0, seqlen_k - col0,
                        window_left, window_right, tile_n, mask_seqlen, mask_right, mask_left)
        return
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = row_start + coords.row(r)
        # Visible offsets (relative to this thread's first column) are [lo, hi).
        hi = Int32(tile_n)
        if cutlass.const_expr(mask_seqlen):
            hi = cutlass.min(hi, seqlen_k - col0)
        if cutlass.const_expr(mask_right):
            hi = cutlass.min(hi, row + window_right + 1 - col0)
        lo = Int32(0)
        if cutlass.const_expr(mask_left):
            lo = row - window_left - col0
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            off = t0[0, j][1]
            if cutlass.const_expr(mask_left):
                if off >= hi or off < lo:
                    s[r, j] = -Float32.inf
            else:
                if off >= hi:
                    s[r, j] = -Float32.inf


@cute.jit
def _mask_by_select(s: cute.Tensor, t0: cute.Tensor, row0: Int32, seq_hi: Int32,
                    window_left: Int32, window_right: Int32, tile_n: cutlass.Constexpr[int],
                    mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
                    mask_left: cutlass.Constexpr[bool]):
    """`apply_mask`'s by_select form on the (rows, cols) view ``s``; ``row0`` is the thread's
    first row minus its first column (absolute), ``seq_hi`` the key length minus that column."""
    neg_inf = Float32(-Float32.inf)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = row0 + t0[r, 0][0]
        hi = Int32(tile_n)
        if cutlass.const_expr(mask_seqlen):
            hi = cutlass.min(hi, seq_hi)
        if cutlass.const_expr(mask_right):
            hi = cutlass.min(hi, row + window_right + 1)
        lo = Int32(0)
        if cutlass.const_expr(mask_left):
            lo = row - window_left
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            off = t0[0, j][1]
            hidden = off >= hi
            if cutlass.const_expr(mask_left):
                hidden = hidden | (off < lo)
            s[r, j] = Float32(cutlass.select_(hidden, neg_inf, s[r, j]))


# -- ALiBi and segment ids (runtime data; shared with the backward kernels) ------------------------
@cute.jit
def apply_alibi(acc_s: cute.Tensor, coords: TileCoords, row_start: Int32, col_start: Int32,
                slope: Float32):
    """s[i, j] -= slope * |i - j| on one block whose first row / column are row_start /
    col_start (absolute positions, top-left aligned as `jaxflash.masking`).

    ``slope`` is in the units of ``acc_s`` (the kernel divides the API's slope by the factor its
    softmax later applies: the softmax scale, or the softcap), so the bias lands in the logits
    exactly where `jaxflash.masking.transform_logits` adds it. Distances are formed in float32
    from a per-row value and compile-time column offsets (exact below 2**24): one FADD and one
    FFMA with an |x| operand per element, no integer conversion in the inner loop.
    """
    s = acc_as_rows_cols(acc_s)
    t0 = coords.t0
    col0 = col_start + coords.base_col
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        d0 = Float32(row_start + coords.row(r) - col0)  # i - (thread's first column)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            d = d0 - Float32(t0[0, j][1])
            s[r, j] = s[r, j] - slope * cute.arch.fmax(d, -d)


@cute.jit
def alibi_distance_dot(acc: cute.Tensor, coords: TileCoords, row_start: Int32,
                       col_start: Int32, total: Float32):
    """total + sum over the thread's elements of acc[i, j] * |i - j| (same positions as
    `apply_alibi`): the backward's d(slope) partial, with acc = dS (the sign is the caller's:
    the logit holds -slope * |i - j|)."""
    s = acc_as_rows_cols(acc)
    t0 = coords.t0
    col0 = col_start + coords.base_col
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        d0 = Float32(row_start + coords.row(r) - col0)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            d = d0 - Float32(t0[0, j][1])
            total = total + s[r, j] * cute.arch.fmax(d, -d)
    return total


class SegmentRows(Carried):
    """Segment facts of one query (row) tile for a thread: the ids of its own rows and the
    tile's (min, max) id, the latter to let whole blocks skip the element compare."""

    _dynamic = ("seg", "lo", "hi")

    def __init__(self, seg: cute.Tensor, lo: Int32, hi: Int32):
        self.seg = seg
        self.lo = lo
        self.hi = hi

    @staticmethod
    @cute.jit
    def load(coords: TileCoords, num_rows: cutlass.Constexpr[int], row_start: Int32,
             row_seg: cute.Tensor, num_valid: Int32, lo: Int32, hi: Int32):
        """``row_seg`` is this batch's 1-D id vector; rows past ``num_valid`` read the last
        valid id (their outputs are never stored)."""
        seg = cute.make_rmem_tensor(cute.make_layout(num_rows), Int32)
        for r in cutlass.range_constexpr(num_rows):
            i = cutlass.min(row_start + coords.row(r), num_valid - 1)
            seg[r] = row_seg[i]
        return SegmentRows(seg, lo, hi)

    @cute.jit
    def block_needs_compare(self, col_lo: Int32, col_hi: Int32):
        """False only when every (row, column) pair of the tile x block shares one segment (the
        element compare can then be skipped); written without ``not`` so the result stays a
        device value."""
        return (self.lo != self.hi) | (col_lo != col_hi) | (self.lo != col_lo)


@cute.jit
def apply_segment_mask(acc_s: cute.Tensor, coords: TileCoords, rows: SegmentRows,
                       col_start: Int32, col_seg: cute.Tensor, num_cols: Int32):
    """Set s[i, j] to -inf where the row's segment differs from column j's.

    ``col_seg`` is this batch's 1-D id vector of length ``num_cols``; columns past it read the
    last id (the sequence-length mask removes them). One load per column a thread owns, shared
    by its rows.
    """
    s = acc_as_rows_cols(acc_s)
    t0 = coords.t0
    col0 = col_start + coords.base_col
    for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
        c = cutlass.min(col0 + t0[0, j][1], num_cols - 1)
        cseg = col_seg[c]
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            if cseg != rows.seg[r]:
                s[r, j] = -Float32.inf


# ---- backward: key-major tiles (rows = keys, columns = queries) --------------------------------
class QueryBlockRange(Carried):
    """Which query blocks see a key block (the backward's loop), mirror of `BlockRange`.

    Key j is visible to query i iff ``i >= j - right`` (right bound) and ``i <= j + left`` (left
    bound); window_right must already be min(right, 0) when causal.
    """

    _dynamic = ("window_left", "window_right")

    def __init__(self, tile_m: int, tile_n: int, has_right: bool, has_left: bool,
                 window_left: Int32, window_right: Int32):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.has_right = has_right
        self.has_left = has_left
        self.window_left = window_left
        self.window_right = window_right

    @cute.jit
    def m_block_min_max(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[m_min, m_max) of query blocks holding a query that sees some key of the block;
        empty when the block starts at or past seqlen_k."""
        m_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        first_key = n_block * self.tile_n
        last_key = cutlass.min((n_block + 1) * self.tile_n, seqlen_k) - 1
        m_min = Int32(0)
        if cutlass.const_expr(self.has_right):
            # the first query that may see the block's first key
            m_min = cutlass.max(first_key - self.window_right, 0) // self.tile_m
        if cutlass.const_expr(self.has_left):
            # queries <= last_key + left see something; a negative bound means no block.
            lim = cutlass.max(last_key + self.window_left + 1, 0)
            m_max = cutlass.min(m_max, (lim + self.tile_m - 1) // self.tile_m)
        if first_key >= seqlen_k:
            m_max = m_min
        m_max = cutlass.max(m_max, m_min)
        return m_min, m_max

    @cute.jit
    def needs_mask(self, n_block: Int32, m_block: Int32, seqlen_k: Int32):
        """Whether some (key, query) of the (n, m) block pair is invisible: the block holds
        keys at or past seqlen_k, or its corner pairs cross the right / left bound."""
        first_key = n_block * self.tile_n
        first_q = m_block * self.tile_m
        need = first_key + self.tile_n > seqlen_k
        if cutlass.const_expr(self.has_right):
            # query first_q must see key first_key + tile_n - 1
            need = need or first_q < first_key + self.tile_n - 1 - self.window_right
        if cutlass.const_expr(self.has_left):
            # query first_q + tile_m - 1 must see key first_key
            need = need or first_q + self.tile_m - 1 > first_key + self.window_left
        return need

    @cute.jit
    def n_block_first(self, m_block: Int32):
        """The first key block whose `m_block_min_max` range holds `m_block` (the key blocks
        holding it are contiguous, as both range ends grow with the key block). Only the left
        bound moves it: query tile_m * m sees keys >= tile_m * m - left, in blocks
        >= (tile_m * m - left) // tile_n."""
        n = Int32(0)
        if cutlass.const_expr(self.has_left):
            n = cutlass.max(m_block * self.tile_m - self.window_left, 0) // self.tile_n
        return n


@cute.jit
def apply_mask_kq(acc_s: cute.Tensor, coords: TileCoords, n_block: Int32, m_block: Int32,
                  tile_n: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
                  seqlen_k: Int32, window_left: Int32, window_right: Int32,
                  mask_right: cutlass.Constexpr[bool], mask_left: cutlass.Constexpr[bool]):
    """Set invisible scores of a transposed (tile_n keys x tile_m queries) block to -inf.

    Keys at or past seqlen_k are always masked (their rows are whole: one compare per row);
    queries are compared as compile-time column offsets against per-row limits.
    """
    s = acc_as_rows_cols(acc_s)
    t0 = coords.t0
    col0 = m_block * tile_m + coords.base_col
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        key = n_block * tile_n + coords.row(r)
        # Visible query offsets (relative to this thread's first column) are [lo, hi).
        lo = Int32(0)
        hi = Int32(tile_m)
        if cutlass.const_expr(mask_right):
            lo = key - window_right - col0
        if cutlass.const_expr(mask_left):
            hi = cutlass.min(hi, key + window_left + 1 - col0)
        if key >= seqlen_k:
            hi = Int32(-1)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            off = t0[0, j][1]
            if cutlass.const_expr(mask_right):
                if off >= hi or off < lo:
                    s[r, j] = -Float32.inf
            else:
                if off >= hi:
                    s[r, j] = -Float32.inf
