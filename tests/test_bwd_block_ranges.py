"""The backward's query-block loop (`mask.QueryBlockRange`, the very DSL code the kernels trace)
run as host JIT code on the CPU against brute-force visibility in numpy, for tile_m 64 and 128:
every visible (query, key) pair lies in a visited block pair, every visited block pair the
kernel leaves unmasked is entirely visible, and the key blocks visiting a query block are the
contiguous run starting at `n_block_first` (what the deterministic semaphores count on).

No GPU: cute.jit host functions execute on the CPU. One compile per (tile_m, mask kind).
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

from jaxflash.kernels.common.mask import QueryBlockRange  # noqa: E402

TILE_N = 128
# (T, S, window (left, right) or None, seqlen_q, seqlen_k): odd sizes, T > S and T < S, partial
# and empty lengths, windows narrower and wider than a block.
PROBLEMS = [(300, 333, None, 300, 333), (1000, 700, None, 1000, 700),
            (400, 150, None, 400, 150), (129, 1000, None, 129, 1000),
            (700, 600, (150, 20), 700, 600), (333, 333, (129, 0), 333, 333),
            (400, 400, (100, 37), 311, 255), (513, 513, (0, 0), 513, 513),
            (1000, 1000, (300, 0), 1000, 0), (260, 270, (50, 20), 0, 270)]


def _host_ranges(tile_m: int, has_right: bool, has_left: bool):
    @cute.jit
    def run(sq: Int32, sk: Int32, wl: Int32, wr: Int32, num_n: Int32, num_m: Int32,
            rng: cute.Tensor, need: cute.Tensor, first: cute.Tensor):
        b = QueryBlockRange(tile_m, TILE_N, has_right, has_left, wl, wr)
        for n in cutlass.range(num_n):
            lo, hi = b.m_block_min_max(n, sq, sk)
            rng[n, 0] = lo
            rng[n, 1] = hi
            for m in cutlass.range(num_m):
                v = Int32(0)
                if b.needs_mask(n, m, sk):
                    v = Int32(1)
                need[n, m] = v
        for m in cutlass.range(num_m):
            first[m] = b.n_block_first(m)

    return run


def _visible(T, S, causal, window, sq, sk):
    """[T, S] bool: key j visible to query i (jax.nn semantics; rows past seqlen_q see nothing,
    keys past seqlen_k are invisible)."""
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    vis = (i < sq) & (j < sk)
    if window is not None:
        left, right = window
        if causal:
            right = min(right, 0)
        vis &= (i >= j - right) & (i <= j + left)
    elif causal:
        vis &= i >= j
    return vis


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "window", "causal window"])
def test_query_block_ranges_match_brute_force(tile_m, kind):
    causal, has_window = "causal" in kind, "window" in kind
    run = _host_ranges(tile_m, causal or has_window, has_window)
    checked = 0
    for T, S, window, sq, sk in PROBLEMS:
        if (window is not None) != has_window:
            continue
        wl, wr = window if window is not None else (0, 0)
        if causal and window is not None:
            wr = min(wr, 0)  # as the kernel passes it
        num_n, num_m = -(-S // TILE_N), -(-T // tile_m)
        rng = np.zeros((num_n, 2), np.int32)
        need = np.zeros((num_n, num_m), np.int32)
        first = np.zeros((num_m,), np.int32)
        run(Int32(sq), Int32(sk), Int32(wl), Int32(wr), Int32(num_n), Int32(num_m),
            from_dlpack(rng), from_dlpack(need), from_dlpack(first))
        vis = _visible(T, S, causal, window, sq, sk)
        # Block pairs as the kernel sees them: query rows past T and keys past S are TMA fill
        # (LSE +inf / masked keys), so pad the visibility with False.
        pad = np.zeros((num_m * tile_m, num_n * TILE_N), bool)
        pad[:T, :S] = vis
        blk = pad.reshape(num_m, tile_m, num_n, TILE_N)
        any_vis = blk.any(axis=(1, 3)).T  # [n, m]
        # Pairs the kernel must mask: invisible by the key bound or the window (rows past
        # seqlen_q or T need no mask: their lse2 is +inf, P = 0).
        iq = np.arange(num_m * tile_m)[:, None]
        jk = np.arange(num_n * TILE_N)[None, :]
        key_ok = (jk < sk) & (jk < S)
        if window is not None:
            left, right = window
            right = min(right, 0) if causal else right
            key_ok = key_ok & (iq >= jk - right) & (iq <= jk + left)
        elif causal:
            key_ok = key_ok & (iq >= jk)
        all_ok = np.broadcast_to(key_ok, pad.shape).reshape(
            num_m, tile_m, num_n, TILE_N).all(axis=(1, 3)).T
        for n in range(num_n):
            lo, hi = rng[n]
            # empty ranges may start past the last block (causal, key block below no query)
            assert 0 <= lo <= hi and (lo == hi or hi <= num_m), (T, S, window, n, lo, hi)
            visited = np.zeros(num_m, bool)
            visited[lo:hi] = True
            # every visible pair is visited
            assert not (any_vis[n] & ~visited).any(), (T, S, window, sq, sk, n, lo, hi)
            for m in range(lo, hi):
                if not need[n, m]:
                    assert all_ok[n, m], (T, S, window, sq, sk, n, m)
        for m in range(num_m):
            holders = [n for n in range(num_n) if rng[n, 0] <= m < rng[n, 1]]
            if holders:  # contiguous, starting at n_block_first (deterministic turn order)
                assert holders == list(range(first[m], first[m] + len(holders))), \
                    (T, S, window, sq, sk, m, holders, first[m])
        checked += 1
    assert checked >= 3
