"""Short sliding windows over long keys (`choose.short_window`: hd 128, > 4k keys, a window
of <= 2048) take the persistent short-loop schedule; on an sm_90 GPU their forward and
gradients match the float32 reference on fresh inputs with odd lengths and GQA. Binaries:
``python -m tests.collect_variants --out DIR -m gpu tests/kernels/test_short_window_gpu.py``."""
from __future__ import annotations

import pytest

from tests.kernels.test_mods_gpu import _check

CASES = [  # (T, S, N, K, window, causal)
    (6000, 6000, 4, 2, (1024, 0), True),
    (4999, 5003, 4, 1, (300, 211), False),
    # causal with a right bound past the diagonal: the window (700, 0) alone's variant, given
    # the clipped bounds (`choose.window_only`)
    (5001, 5001, 4, 2, (700, 40), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-w{c[4][0]}-{c[4][1]}")
def test_short_window_matches_reference(case):
    T, S, N, K, window, causal = case
    _check(1, T, S, N, K, 128, dict(local_window_size=window, is_causal=causal))
