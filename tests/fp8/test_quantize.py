"""`jaxflash.quantize`: FP8 round trips, the three scale layouts, the amax / saturation / zero
rules, and the random-sign Hadamard transform (orthogonal, cancels in Q K^T)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxflash import quantize as Q


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype,fmax,mant", [(jnp.float8_e4m3fn, 448.0, 3),
                                             (jnp.float8_e5m2, 57344.0, 2)])
@pytest.mark.parametrize("gran", Q.GRANULARITIES)
def test_round_trip_and_layout(dtype, fmax, mant, gran):
    x = _x((2, 3, 200, 4, 16))            # two batch dims, L = 200 (a short last block)
    x[0, 1, 130:, 2] *= 50.0               # a loud region: per-block scales must follow it
    x8, s = Q.quantize(x, dtype, granularity=gran, block_size=64)
    want = {"tensor": (), "head": (2, 3, 4), "block": (2, 3, 4, 4)}[gran]
    assert x8.dtype == jnp.dtype(dtype) and x8.shape == x.shape and s.shape == want
    assert s.dtype == jnp.float32
    y = np.asarray(Q.dequantize(x8, s, block_size=64))
    # Each block's largest magnitude lands on FMAX (the amax rule).
    xb = np.asarray(x8.astype(jnp.float32))
    assert np.abs(xb).max() == fmax
    # Normal values keep `mant` mantissa bits: relative error <= 2^-(mant+1); tiny values are
    # bounded by half the smallest subnormal step times their scale.
    sc = np.asarray(Q.expand_scale(s, x.shape, gran, 64))
    sub = {3: 2.0 ** -9, 2: 2.0 ** -16}[mant]
    err = np.abs(y - x)
    assert np.all(err <= 2.0 ** -(mant + 1) * np.abs(x) * 1.0001 + sub * sc * 0.5 + 1e-30)
    if gran == "block":  # the loud block did not coarsen its quiet neighbours
        quiet = np.asarray(s)[0, 1, 2, 0]
        loud = np.asarray(s)[0, 1, 2, 3]
        assert loud > 20 * quiet


def test_zero_nan_saturation_and_given_scale():
    x = np.zeros((1, 128, 2, 16), np.float32)
    x[0, :, 1] = _x((128, 16))
    x8, s = Q.quantize(x, granularity="head")
    assert float(s[0, 0]) == 1.0 and not np.any(np.asarray(x8[0, :, 0].astype(jnp.float32)))
    y = np.asarray(Q.dequantize(x8, s))
    assert np.all(y[0, :, 0] == 0)
    x[0, 5, 1, 3] = np.nan                  # a NaN poisons its block, visibly
    y = np.asarray(Q.dequantize(*Q.quantize(x, granularity="head")))
    assert np.all(np.isnan(y[0, :, 1])) and np.all(y[0, :, 0] == 0)
    # A caller's scale saturates instead of overflowing to NaN (E4M3) / Inf (E5M2).
    big = np.full((1, 4, 1, 16), 1e6, np.float32)
    for dt, m in ((jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)):
        x8, s = Q.quantize(big, dt, granularity="tensor", scale=1.0)
        assert np.all(np.asarray(x8.astype(jnp.float32)) == m) and float(s) == 1.0


def test_scale_layout_errors_name_the_shapes():
    x = jnp.zeros((2, 256, 4, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(2, 4, 3\).*\(2, 256, 4, 64\)"):
        Q.dequantize(x, jnp.ones((2, 4, 3)))
    with pytest.raises(ValueError, match="granularity"):
        Q.quantize(np.ones((1, 8, 1, 16)), granularity="row")
    with pytest.raises(ValueError, match="float8"):
        Q.quantize(np.ones((1, 8, 1, 16)), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        Q.quantize(np.ones((1, 8, 1, 16)), granularity="head", scale=np.ones((2,)))
    assert Q.infer_granularity((2, 256, 4, 64), (2, 4, 2), 128) == "block"


def _sylvester(D):
    H = np.array([[1.0]])
    while H.shape[0] < D:
        H = np.block([[H, H], [H, -H]])
    return H


@pytest.mark.parametrize("D", [64, 128, 256])
def test_hadamard_orthogonal_and_cancels(D):
    q, k = _x((1, 32, 2, D), 1), _x((1, 48, 2, D), 2)
    e = np.zeros((1, 1, 1, D), np.float32)
    e[..., 3] = 100.0

    @jax.jit  # one program: eagerly each butterfly stage would compile on its own
    def run(eye, q, k, e):
        f = lambda x: Q.hadamard(x, 7)
        return f(eye), f(q), f(k), Q.inverse_hadamard(f(q), 7), f(e), Q.hadamard_signs(7, D)

    M, qh, kh, back, eh, signs = (np.asarray(r, np.float64) for r in
                                  run(jnp.eye(D, dtype=jnp.float32), q, k, e))
    np.testing.assert_allclose(M @ M.T, np.eye(D), atol=1e-5)      # rows: images of e_i
    np.testing.assert_allclose(M, signs[:, None] * _sylvester(D) / np.sqrt(D), atol=1e-6)
    s0 = np.einsum("btnd,bsnd->bnts", q.astype(np.float64), k.astype(np.float64))
    s1 = np.einsum("btnd,bsnd->bnts", qh, kh)
    np.testing.assert_allclose(s1, s0, atol=2e-4 * np.sqrt(D))
    np.testing.assert_allclose(back, q, atol=1e-5)
    # An outlier channel is spread: its energy moves to all D channels equally.
    assert np.allclose(np.abs(eh), 100.0 / np.sqrt(D), rtol=1e-5)


def test_hadamard_seeds_and_dims():
    a, b = Q.hadamard_signs(0, 128), Q.hadamard_signs(1, 128)
    assert set(np.unique(np.asarray(a))) == {-1.0, 1.0} and np.any(np.asarray(a != b))
    kk = Q.hadamard_signs(jax.random.key(3), 64)           # a jax key works, traced
    assert kk.shape == (64,) and set(np.unique(np.asarray(kk))) <= {-1.0, 1.0}
    with pytest.raises(ValueError, match="head dims"):
        Q.hadamard(np.ones((1, 2, 1, 96), np.float32))


def test_matches_ml_dtypes_rounding():
    """XLA's convert is the round-to-nearest-even of ml_dtypes (what cvt.rn.satfinite does)."""
    x = _x((1, 64, 1, 32), 5) * 3.0
    x8, s = Q.quantize(x, granularity="tensor")
    want = np.clip(x * np.float32(448.0 / np.abs(x).max()), -448, 448).astype(
        ml_dtypes.float8_e4m3fn)
    assert np.array_equal(np.asarray(x8).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_empty_operands_quantize(granularity):
    """An empty operand (no rows, or no batch) quantizes as a zero one: scale 1, no codes."""
    for shape in ((2, 0, 4, 64), (0, 8, 4, 64)):
        x8, s = Q.quantize(jnp.zeros(shape, jnp.bfloat16), granularity=granularity)
        assert x8.shape == shape and x8.dtype == jnp.float8_e4m3fn
        assert s.shape == Q.scale_shape(shape, granularity, 128) and bool(jnp.all(s == 1))
