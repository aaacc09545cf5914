"""Block skipping of the Pallas kernels against brute force: a skipped tile holds no visible
pair, a tile run without the causal/window select is fully visible and not ragged, and with
whole blocks no tile with nothing visible is visited (the skipping is tight)."""

import numpy as np
import pytest

from jaxflash.pallas_fallback.tiles import Spec, k_block_range, q_block_range


def _spec(T, S, causal, window):
    return Spec(T=T, S=S, H=16, Hv=16, Hp=16, Hvp=16, G=1, scale=1.0, is_causal=causal,
                window=window, softcap=None, has_alibi=False, has_bias=False, has_mask=False,
                has_seg=False, has_qlen=False, has_kvlen=False)


def _visible(T, S, causal, window):
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    ok = np.ones((T, S), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    return ok


CASES = [(T, S, c, w) for (T, S) in ((64, 64), (40, 70), (77, 33), (128, 96))
         for c in (False, True) for w in (None, (0, 0), (5, 3), (20, 0), (0, 40), (100, 100))]


@pytest.mark.parametrize("T, S, causal, window", CASES)
@pytest.mark.parametrize("bq, bk", [(16, 32), (32, 16)])
def test_block_ranges(T, S, causal, window, bq, bk):
    spec = _spec(T, S, causal, window)
    vis = _visible(T, S, causal, window)
    nq, nk = -(-T // bq), -(-S // bk)
    tile = lambda i, j: vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
    whole = lambda i, j: (i + 1) * bq <= T and (j + 1) * bk <= S
    for i in range(nq):  # forward / dQ orientation
        lo, a, b, hi = (int(x) for x in k_block_range(i * bq, bq, bk, spec))
        assert 0 <= lo <= a <= b <= hi <= nk
        for j in range(nk):
            if not lo <= j < hi:
                assert not tile(i, j).any(), f"q block {i} skips visible k block {j}"
            elif whole(i, j) and (i + 1) * bq <= T:
                assert tile(i, j).any(), f"q block {i} visits empty k block {j}"
            if a <= j < b:
                assert (j + 1) * bk <= S and tile(i, j).all() and tile(i, j).shape[0] > 0
    for j in range(nk):  # dK/dV orientation
        lo, a, b, hi = (int(x) for x in q_block_range(j * bk, bq, bk, spec))
        assert 0 <= lo <= a <= b <= hi <= nq
        for i in range(nq):
            if not lo <= i < hi:
                assert not tile(i, j).any(), f"k block {j} skips visible q block {i}"
            elif whole(i, j):
                assert tile(i, j).any(), f"k block {j} visits empty q block {i}"
            if a <= i < b:
                assert (i + 1) * bq <= T and tile(i, j).all()


def test_seq_lengths_skip_blocks():
    spec = _spec(64, 64, False, None)
    lo, a, b, hi = (int(x) for x in k_block_range(0, 16, 16, spec, kv_len=20))
    assert (lo, hi) == (0, 2)
    lo, a, b, hi = (int(x) for x in k_block_range(32, 16, 16, spec, q_len=32))
    assert hi == lo
    lo, a, b, hi = (int(x) for x in q_block_range(16, 16, 16, spec, q_len=40))
    assert hi == 3
    lo, a, b, hi = (int(x) for x in q_block_range(48, 16, 16, spec, kv_len=48))
    assert hi == lo
