"""NaN and +-Inf on the GPU backends (the CuTe kernels, cuDNN): the same documented pattern as
on the CPU backends (`test_bad_values.py`, which also states the known deviations), for every
case that needs no dense bias (the CuTe kernels take none; a bias call would run elsewhere).

bfloat16 inputs at head dim 64 (the kernels' smallest); T = S = 200 so causal masking and the
lengths cut through several 64 / 128-row tiles. The pattern must match the float64 model
exactly; finite values within bfloat16 accuracy. Skipped without a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests.extremes import npref

pytestmark = pytest.mark.gpu

T = S = 200
N, K, H = 2, 1, 64
NAN, INF = np.nan, np.inf
CASES = {
    "clean": lambda q, k, v, ql, kl: None,
    "q_nan": lambda q, k, v, ql, kl: q.__setitem__((5, 0, 3), NAN),
    "k_nan": lambda q, k, v, ql, kl: k.__setitem__((130, 0, 2), NAN),
    "q_posinf": lambda q, k, v, ql, kl: q.__setitem__((7, 0, 0), INF),
    "v_nan_seen": lambda q, k, v, ql, kl: v.__setitem__((0, 0, 1), NAN),
    "v_inf_seen": lambda q, k, v, ql, kl: v.__setitem__((0, 0, 2), INF),
    "k_nan_beyond_len": lambda q, k, v, ql, kl: (k.__setitem__(190, NAN),
                                                 kl.__setitem__((), 150)),
    "q_nan_beyond_len": lambda q, k, v, ql, kl: (q.__setitem__((170, 1), NAN),
                                                 ql.__setitem__((), 160)),
}
NAMES = list(CASES)


def _inputs():
    rng = np.random.default_rng()
    B = len(NAMES)
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    q, k, v = (bf(rng.standard_normal(s)) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    ql, kl = np.full(B, T, np.int32), np.full(B, S, np.int32)
    for b, name in enumerate(NAMES):
        CASES[name](q[b], k[b], v[b], ql[b:b + 1].reshape(()), kl[b:b + 1].reshape(()))
    return q, k, v, ql, kl


@pytest.fixture(scope="module")
def data():
    q, k, v, ql, kl = _inputs()
    ref = npref.attention(q, k, v, None, is_causal=True, q_lens=ql, kv_lens=kl)
    got = {}
    for impl in ("cute", "cudnn"):
        f = jax.jit(lambda q, k, v: jaxflash.flash_attention(
            q, k, v, is_causal=True, query_seq_lengths=jnp.asarray(ql),
            key_value_seq_lengths=jnp.asarray(kl), implementation=impl, return_residual=True))
        try:
            out, lse = f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
            got[impl] = (np.asarray(out.astype(jnp.float32)), np.asarray(lse))
        except NotImplementedError as e:
            got[impl] = e
    return ref, got


def _pattern(x):
    return {"nan": np.isnan(x), "+inf": np.isposinf(x), "-inf": np.isneginf(x)}


@pytest.mark.parametrize("impl", ["cute", "cudnn"])
@pytest.mark.parametrize("name", NAMES)
def test_output_pattern(data, impl, name):
    (ref_out, _), got = data
    if isinstance(got[impl], NotImplementedError):
        pytest.skip(f"{impl}: {got[impl]}")
    b = NAMES.index(name)
    out = got[impl][0][b]
    for kind, mask in _pattern(ref_out[b]).items():
        g = _pattern(out)[kind]
        assert np.array_equal(g, mask), (
            f"{impl} {name}: {kind} at {np.argwhere(g).tolist()[:6]} (of {g.sum()}), expected "
            f"{np.argwhere(mask).tolist()[:6]} (of {mask.sum()})")
    fin = np.isfinite(ref_out[b])
    np.testing.assert_allclose(out[fin], ref_out[b][fin], rtol=2e-2, atol=2e-2)
