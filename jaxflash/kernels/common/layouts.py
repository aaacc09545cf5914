"""Layout helpers for sm_90 wgmma fragments and shared-memory tiles (CuTe DSL).

A wgmma accumulator fragment per thread has the layout ``((2, 2, N/8), MMA_M, MMA_N)``: mode
0.0 walks two adjacent columns, mode 0.1 two rows 8 apart, mode 0.2 the 8-column groups. The
softmax wants it as a (rows, cols) matrix, and the PV GEMM (A from registers) wants the same
registers grouped as A-operand k-blocks of 16 columns. Both are pure re-views: no data moves.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an sm_90 accumulator ((2, 2, V), M, N) as ((2, M), (2, V, N)) = (rows, cols)."""
    flat = cute.make_layout(acc.layout.shape)  # compact column-major view of the index space
    s, d = flat.shape, flat.stride
    rows = ((s[0][1], s[1]), (d[0][1], d[1]))
    cols = ((s[0][0], s[0][2], s[2]), (d[0][0], d[0][2], d[2]))
    mn = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an sm_90 16-bit-input accumulator ((2, 2, V), M, N) as an RS A operand.

    wgmma's A fragment for a 16-wide k-block is ((2, 2, 2), M, K): two 8-column groups of the
    accumulator form one k-block, so V splits as (2, V/2) and the V/2 part becomes the k mode.
    """
    lay = acc.layout
    v = lay.shape[0][2]
    assert v % 2 == 0, "accumulator width must be a multiple of 16 to feed an RS wgmma"
    split = cute.logical_divide(lay, ((None, None, 2), None, None))
    s, d = split.shape, split.stride
    a = cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )
    return cute.make_tensor(acc.iterator, a)


def acc_as_fp8_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an sm_90 accumulator ((2, 2, V), M, N) as the values of an FP8 RS A operand, in
    the A fragment's value order (((2, 2), 2, 2), 1, V / 4).

    The 8-bit A fragment of a 32-wide k-block holds, per thread, 4 consecutive k positions per
    row (rows r and r + 8) for k and k + 16. The accumulator's columns of one thread are not
    consecutive ({2q, 2q+1, 2q+8, 2q+9} per 16), so the A positions are given the thread's own
    columns in that order (pair, then 8-column group), and V's keys are permuted to match when
    V is transposed (`jaxflash.kernels.sm90.v_transpose`). V splits as (2, 2, V/4): the first 2
    joins the column pair (A's 4 consecutive positions), the second is the k + 16 half.
    """
    s, d = acc.layout.shape, acc.layout.stride
    v, dv = s[0][2], d[0][2]
    assert isinstance(v, int) and v % 4 == 0, (
        "accumulator width must be a multiple of 32 to feed an FP8 RS wgmma")
    assert s[1] == 1 and s[2] == 1, f"one MMA tile per warpgroup expected: {acc.layout}"
    a = cute.make_layout(
        (((s[0][0], 2), s[0][1], 2), 1, v // 4),
        stride=(((d[0][0], dv), d[0][1], 2 * dv), 0, 4 * dv),
    )
    return cute.make_tensor(acc.iterator, a)


def fp8_operand_a_values(frag: cute.Tensor) -> cute.Tensor:
    """View an FP8 RS A fragment ((4, 2, 2), M, K) as (((2, 2), 2, 2), M, K): the shape of
    `acc_as_fp8_operand_a`, so a converted accumulator can be stored into it."""
    s, d = frag.layout.shape, frag.layout.stride
    assert s[0][0] == 4 and isinstance(d[0][0], int), f"not an FP8 A fragment: {frag.layout}"
    a = cute.make_layout(
        (((2, 2), s[0][1], s[0][2]), s[1], s[2]),
        stride=(((d[0][0], 2 * d[0][0]), d[0][1], d[0][2]), d[1], d[2]),
    )
    return cute.make_tensor(frag.iterator, a)


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None,
                atom_cols: int | None = None, swizzle: bool = True):
    """Swizzled K-major (row-major) shared-memory layout for a rows x cols tile (x stages).

    The swizzle atom width follows the row width in bytes (128B when it allows), so TMA writes
    and wgmma reads are bank-conflict free. ``atom_cols`` (default ``cols``) picks the atom for
    a narrower width instead: a tile read as an MN-major wgmma operand in column slices (e.g.
    half the head dim per warpgroup) needs every slice to be whole swizzle atoms.
    ``swizzle=False`` keeps the atoms' arrangement (8-row blocks of atom_cols columns, tiled
    rows first) with an identity swizzle: thread addresses are then affine (base + constants).
    """
    kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    if stages is None:
        layout = cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    else:
        layout = cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))
    if not swizzle:
        layout = cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, layout.outer)
    return layout


def tma_tiles(atom, smem: cute.Tensor, gmem: cute.Tensor, rank: int = 2):
    """(smem view, gmem view) of a TMA copy whose box is the first `rank` modes of both tiles
    (a CTA issuing alone, no multicast): what every TMA load and store in these kernels uses."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, rank),
                                 cute.group_modes(gmem, 0, rank))


def transpose_mn(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (rows, cols, ...) smem tensor without moving data."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """Reorder a tensor's modes (a view)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
          zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int],
          clear: cutlass.Constexpr[bool] = False):
    """Issue acc (+)= a @ b over all k-blocks as one wgmma group; wait for <= `wait` groups
    in flight afterwards (-1: do not wait).

    clear (with zero_init): write zeros into acc first. The wgmma reads its accumulator
    operand even when told not to accumulate, so without this the stale value the tensor held
    stays live up to the GEMM; inside a loop that can be a whole other accumulator (measured: the
    persistent forward kept the first block's S, 64 registers, live across its mainloop and
    ptxas serialized every wgmma, C7512). ptxas drops the zeros (the GEMM ignores them)."""
    if cutlass.const_expr(zero_init and clear):
        acc.fill(0.0)
    warpgroup.fence()
    # The accumulate flag is state of the MMA atom's IR value; setting it on the caller's
    # tiled MMA inside runtime control flow would leak a region-local value. Use a fresh atom.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for kb in cutlass.range_constexpr(cute.size(a.shape[2])):
        cute.gemm(atom, acc, a[None, None, kb], b[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)
