"""The forward's key-block loop and row ranges (`mask.BlockRange`, the very DSL code the kernel
traces) run as host JIT code on the CPU against brute force in numpy, for start-aligned and
clamped end-aligned query tiles (``FwdConfig.m_align``), tile_m 128 / 192, tile_n 64 / 128:

- rows: every tile's box [first_row, first_row + tile_m) starts at row >= 0 (a TMA box at a
  negative row crashed the first end-aligned attempt on the H200) and, end-aligned with
  T >= tile_m, ends inside T; the owned rows [.., own_end) (the LSE writers) cover [0, T)
  exactly once; end-aligned tiles share rows only between tiles 0 and 1.
- key blocks: [n_min, n_max) equals the first / last key block visible to some row of the box
  (exact when anything is visible), and every block the kernel runs without an element mask is
  entirely visible to the box's rows.
- shared rows: tile 0 and tile 1 both visit every key block a shared row sees (the condition of
  the bitwise-identity argument in NOTES.md, "End-aligned query tiles v2").
Also the point of end alignment: the key-block iterations it saves at T = S = 1k and 4k causal.

No GPU: cute.jit host functions execute on the CPU. One trace per (tiles, alignment, mask).
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


def _problems(has_window: bool, end: bool):
    """(T, S, window, seqlen_q, seqlen_k): the backward test's problems plus seeded random ones
    around the tile sizes (T = 1000, T < tile_m, T a multiple of 192, T > S, T < S, short kv
    lengths). End alignment is refused with query lengths (seqlen_q == T there)."""
    rng = np.random.default_rng(7)
    out = [p for p in PROBLEMS if (p[2] is not None) == has_window]
    for T, S in [(1000, 1000), (1024, 1024), (100, 100), (100, 700), (384, 384), (193, 193),
                 (1100, 700), (900, 1100), (1000, 1300), (257, 1000), (2000, 2000)]:
        out.append((T, S, (129, 0) if has_window else None, T, S))
    for _ in range(14):
        T, S = (int(x) for x in rng.integers(1, 1500, 2))
        window = (int(rng.integers(0, 400)), int(rng.integers(0, 200))) if has_window else None
        sk = S if rng.random() < 0.6 else int(rng.integers(0, S + 1))
        sq = T if (end or rng.random() < 0.6) else int(rng.integers(0, T + 1))
        out.append((T, S, window, sq, sk))
    return [p for p in out if p[0] > 0 and not (end and p[3] != p[0])]


def _host_ranges(tile_m: int, tile_n: int, has_right: bool, has_left: bool, end: bool):
    @cute.jit
    def run(T: Int32, sq: Int32, sk: Int32, wl: Int32, wr: Int32, num_m: Int32,
            out: cute.Tensor):
        row_shift = None
        if cutlass.const_expr(end):
            row_shift = num_m * tile_m - T  # as `FlashFwdSm90.kernel` computes it
        b = BlockRange(tile_m, tile_n, has_right, has_left, wl, wr, row_shift)
        for m in cutlass.range(num_m):
            lo, hi = b.n_block_min_max(m, sq, sk)
            out[m, 0] = lo
            out[m, 1] = hi
            out[m, 2] = b.n_block_min_right_mask(m, lo)
            out[m, 3] = b.n_block_min_no_left_mask(m, lo)
            out[m, 4] = b.first_row(m)
            out[m, 5] = b.own_end(m, T)

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
@pytest.mark.parametrize("end", [False, True], ids=["start", "end"])
@pytest.mark.parametrize("kind", ["causal", "window", "causal window"])
def test_row_and_key_block_ranges_match_brute_force(tiles, end, kind):
    tile_m, tile_n = tiles
    causal, has_window = "causal" in kind, "window" in kind
    run = _host_ranges(tile_m, tile_n, causal or has_window, has_window, end)
    checked = 0
    for T, S, window, sq, sk in _problems(has_window, end):
        wl, wr = window if window is not None else (0, 0)
        if causal and window is not None:
            wr = min(wr, 0)
        num_m = -(-T // tile_m)
        shift = num_m * tile_m - T
        out = np.zeros((num_m, 6), np.int32)
        run(Int32(T), Int32(sq), Int32(sk), Int32(wl), Int32(wr), Int32(num_m),
            from_dlpack(out))
        vis = _visible(T, S, causal, window, sq, sk)
        owner = np.zeros(T, np.int32)
        ctx = (T, S, window, sq, sk)
        for m in range(num_m):
            n_min, n_max, n_right, n_left, r0, own_end = (int(x) for x in out[m])
            want_r0 = max(m * tile_m - shift, 0) if end else m * tile_m
            assert r0 == want_r0 >= 0, (ctx, m)
            if end and T >= tile_m:
                assert r0 + tile_m <= T, (ctx, m)  # no box clipped at the end either
            own_lo = max(m * tile_m - shift, 0) if end else m * tile_m
            owner[own_lo:min(own_end, r0 + tile_m, T)] += 1
            assert own_end <= T or not end, (ctx, m)
            # Rows past seqlen_q are never stored (O 0, LSE -inf): only the rest must be right.
            box = np.arange(r0, min(r0 + tile_m, T, sq))
            cols = np.nonzero(vis[box].any(axis=0))[0]
            if cols.size:  # exactly the blocks from the first to the last visible key
                assert (n_min, n_max) == (cols[0] // tile_n, cols[-1] // tile_n + 1), (ctx, m)
            for n in _unmasked(n_min, n_max, n_right, n_left):
                assert vis[np.ix_(box, np.arange(n * tile_n, (n + 1) * tile_n))].all(), \
                    (ctx, m, n)
        assert (owner == 1).all(), (ctx, owner)
        if end and num_m > 1 and shift:
            # Rows both tile 0 and tile 1 compute: each tile visits every block they see.
            (lo0, hi0), (lo1, hi1) = out[0, :2], out[1, :2]
            for i in range(tile_m - shift, tile_m):
                seen = np.nonzero(vis[i])[0] // tile_n
                assert seen.size == 0 or (max(lo0, lo1) <= seen.min()
                                          and seen.max() < min(hi0, hi1)), (ctx, i)
        checked += 1
    assert checked >= 10


def _causal_block_visits(T, tile_m, end, tile_n=128):
    """Key-block iterations of all query tiles at T = S, causal (what the tiles cost)."""
    num_m = -(-T // tile_m)
    shift = num_m * tile_m - T if end else 0
    return sum(-(-min(max(m * tile_m - shift, 0) + tile_m, T) // tile_n)
               for m in range(num_m))


def test_end_alignment_saves_causal_work():
    # 1k: 2+3+5+6+8+8 -> 2+2+4+5+7+8 (the clamped first tile still runs its 192 rows).
    assert (_causal_block_visits(1024, 192, False), _causal_block_visits(1024, 192, True)) \
        == (32, 28)
    assert _causal_block_visits(4096, 192, True) < 0.97 * _causal_block_visits(4096, 192, False)
