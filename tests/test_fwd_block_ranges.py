"""The forward's key-block loop (`mask.BlockRange`, the very DSL code the kernel traces) run as
host JIT code on the CPU against brute-force visibility in numpy, for start- and end-aligned
query tiles (``FwdConfig.m_align``) at tile_m 128 and 192: the tiles cover rows [0, T) once,
every visible (query, key) pair of a real row lies in a visited key block (and the last block
visited holds one), and every block the kernel runs without an element mask is entirely
visible to the tile's real rows. Also the point of end alignment: the work (block visits) it
saves at T = S = 1k and 4k, causal.

No GPU: cute.jit host functions execute on the CPU. One compile per (alignment, mask kind).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the DSL is imported anywhere

cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402  (module level: the jit reads its annotations here)
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from jaxflash.kernels.mask import BlockRange  # noqa: E402
from tests.test_bwd_block_ranges import PROBLEMS, TILE_N, _visible  # noqa: E402


def _host_ranges(tile_m: int, has_right: bool, has_left: bool, end: bool):
    @cute.jit
    def run(sq: Int32, sk: Int32, wl: Int32, wr: Int32, shift: Int32, num_m: Int32,
            out: cute.Tensor):
        row_shift = None
        if cutlass.const_expr(end):
            row_shift = shift
        b = BlockRange(tile_m, TILE_N, has_right, has_left, wl, wr, row_shift)
        for m in cutlass.range(num_m):
            lo, hi = b.n_block_min_max(m, sq, sk)
            out[m, 0] = lo
            out[m, 1] = hi
            out[m, 2] = b.n_block_min_right_mask(m, lo)
            out[m, 3] = b.n_block_min_no_left_mask(m, lo)
            out[m, 4] = b.first_row(m)

    return run


def _unmasked(n_min, n_max, n_right, n_left):
    """Key blocks the consumer runs without an element mask (`FlashFwdSm90.consume`): the
    rightmost block is always masked, then [n_right, n) right-masked, [n_left, n_right) none,
    the rest left-masked."""
    n = n_max - 1
    n_right = min(max(n_right, n_left), n)  # the loop counts clamp at zero
    return range(max(n_left, n_min), n_right) if n_max > n_min else range(0)


@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("end", [False, True], ids=["start", "end"])
@pytest.mark.parametrize("kind", ["causal", "window", "causal window"])
def test_key_block_ranges_match_brute_force(tile_m, end, kind):
    causal, has_window = "causal" in kind, "window" in kind
    run = _host_ranges(tile_m, causal or has_window, has_window, end)
    checked = 0
    for T, S, window, sq, sk in PROBLEMS:
        if (window is not None) != has_window or (end and sq != T) or T == 0:
            continue  # end alignment is refused with query lengths
        wl, wr = window if window is not None else (0, 0)
        if causal and window is not None:
            wr = min(wr, 0)
        num_m = -(-T // tile_m)
        shift = num_m * tile_m - T
        out = np.zeros((num_m, 5), np.int32)
        run(Int32(sq), Int32(sk), Int32(wl), Int32(wr), Int32(shift), Int32(num_m),
            from_dlpack(out))
        vis = _visible(T, S, causal, window, sq, sk)
        rows = []
        for m in range(num_m):
            n_min, n_max, n_right, n_left, r0 = (int(x) for x in out[m])
            assert r0 == m * tile_m - (shift if end else 0)
            real = np.arange(max(r0, 0), min(r0 + tile_m, T))
            rows += list(real)
            cols = np.nonzero(vis[real].any(axis=0))[0]
            # visited: every visible key; and no block past the last one (the saving)
            assert cols.size == 0 or (n_min <= cols[0] // TILE_N
                                      and cols[-1] // TILE_N == n_max - 1), (T, S, window, m)
            for n in _unmasked(n_min, n_max, n_right, n_left):
                assert vis[np.ix_(real, np.arange(n * TILE_N, (n + 1) * TILE_N))].all(), \
                    (T, S, window, m, n)
        assert rows == list(range(T))
        checked += 1
    assert checked >= 2


def _causal_block_visits(T, tile_m, end):
    """Key-block iterations of all query tiles at T = S, causal (what the tiles cost)."""
    num_m = -(-T // tile_m)
    shift = num_m * tile_m - T if end else 0
    return sum(-(-min(m * tile_m - shift + tile_m, T) // TILE_N) for m in range(num_m))


def test_end_alignment_saves_causal_work():
    assert (_causal_block_visits(1024, 192, False), _causal_block_visits(1024, 192, True)) \
        == (32, 27)
    assert _causal_block_visits(4096, 192, True) < 0.96 * _causal_block_visits(4096, 192, False)
