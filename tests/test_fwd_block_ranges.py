"""The forward's key-block loop and row ranges (`mask.BlockRange`, the very DSL code the kernel
traces) run as host JIT code on the CPU against brute force in numpy, for tile_m 128 / 192,
tile_n 64 / 128:

- rows: tile m's box starts at row m * tile_m; the rows below T (the LSE writers) cover [0, T)
  exactly once.
- key blocks: [n_min, n_max) equals the first / last key block visible to some row of the box
  (exact when anything is visible), and every block the kernel runs without an element mask is
  entirely visible to the box's rows.

No GPU: cute.jit host functions execute on the CPU. One trace per (tiles, mask).
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

from jaxflash.kernels.common.mask import BlockRange  # noqa: E402
from tests.test_bwd_block_ranges import PROBLEMS, _visible  # noqa: E402


def _problems(has_window: bool):
    """(T, S, window, seqlen_q, seqlen_k): the backward test's problems plus seeded random ones
    around the tile sizes (T = 1000, T < tile_m, T a multiple of 192, T > S, T < S, short
    lengths)."""
    rng = np.random.default_rng(7)
    out = [p for p in PROBLEMS if (p[2] is not None) == has_window]
    for T, S in [(1000, 1000), (1024, 1024), (100, 100), (100, 700), (384, 384), (193, 193),
                 (1100, 700), (900, 1100), (1000, 1300), (257, 1000), (2000, 2000)]:
        out.append((T, S, (129, 0) if has_window else None, T, S))
    for _ in range(14):
        T, S = (int(x) for x in rng.integers(1, 1500, 2))
        window = (int(rng.integers(0, 400)), int(rng.integers(0, 200))) if has_window else None
        sk = S if rng.random() < 0.6 else int(rng.integers(0, S + 1))
        sq = T if rng.random() < 0.6 else int(rng.integers(0, T + 1))
        out.append((T, S, window, sq, sk))
    return [p for p in out if p[0] > 0]


def _host_ranges(tile_m: int, tile_n: int, has_right: bool, has_left: bool):
    @cute.jit
    def run(sq: Int32, sk: Int32, wl: Int32, wr: Int32, num_m: Int32, out: cute.Tensor):
        b = BlockRange(tile_m, tile_n, has_right, has_left, wl, wr)
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


@pytest.mark.parametrize("tiles", [(192, 128), (128, 128), (128, 64), (192, 64)],
                         ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("kind", ["causal", "window", "causal window"])
def test_row_and_key_block_ranges_match_brute_force(tiles, kind):
    tile_m, tile_n = tiles
    causal, has_window = "causal" in kind, "window" in kind
    run = _host_ranges(tile_m, tile_n, causal or has_window, has_window)
    checked = 0
    for T, S, window, sq, sk in _problems(has_window):
        wl, wr = window if window is not None else (0, 0)
        if causal and window is not None:
            wr = min(wr, 0)
        num_m = -(-T // tile_m)
        out = np.zeros((num_m, 5), np.int32)
        run(Int32(sq), Int32(sk), Int32(wl), Int32(wr), Int32(num_m), from_dlpack(out))
        vis = _visible(T, S, causal, window, sq, sk)
        owner = np.zeros(T, np.int32)
        ctx = (T, S, window, sq, sk)
        for m in range(num_m):
            n_min, n_max, n_right, n_left, r0 = (int(x) for x in out[m])
            assert r0 == m * tile_m, (ctx, m)
            owner[r0:min(r0 + tile_m, T)] += 1  # the epilogue writes LSE for rows below T
            # Rows past seqlen_q are never stored (O 0, LSE -inf): only the rest must be right.
            box = np.arange(r0, min(r0 + tile_m, T, sq))
            cols = np.nonzero(vis[box].any(axis=0))[0]
            if cols.size:  # exactly the blocks from the first to the last visible key
                assert (n_min, n_max) == (cols[0] // tile_n, cols[-1] // tile_n + 1), (ctx, m)
            for n in _unmasked(n_min, n_max, n_right, n_left):
                assert vis[np.ix_(box, np.arange(n * tile_n, (n + 1) * tile_n))].all(), \
                    (ctx, m, n)
        assert (owner == 1).all(), (ctx, owner)
        checked += 1
    assert checked >= 10
