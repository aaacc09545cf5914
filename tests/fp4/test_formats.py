"""Exhaustive tests of jaxflash.fp4.formats against ml_dtypes and an independent NumPy reference
written here from the bit definitions (float64 nearest-value search, not bit tricks)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxflash.fp4 import formats as F

# ------------------------------------------------------------------ independent reference
def ref_values(ebits, mbits, bias, has_inf=False):
    """float64 value of every code (sign in the top bit); NaN for NaN codes, inf for inf codes."""
    n = 1 + ebits + mbits
    vals = np.empty(1 << n)
    for c in range(1 << n):
        s = -1.0 if c >> (ebits + mbits) else 1.0
        e = (c >> mbits) & ((1 << ebits) - 1)
        m = c & ((1 << mbits) - 1)
        if e == (1 << ebits) - 1 and ebits == 5:          # E5M2: IEEE specials
            vals[c] = s * np.inf if m == 0 else np.nan
        elif e == (1 << ebits) - 1 and m == (1 << mbits) - 1 and ebits == 4:  # E4M3FN NaN
            vals[c] = np.nan
        elif e == 0:
            vals[c] = s * m * 2.0 ** (1 - bias - mbits)
        else:
            vals[c] = s * (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
    return vals


E2M1_REF = ref_values(2, 1, 1)
E4M3_REF = ref_values(4, 3, 7)
E5M2_REF = ref_values(5, 2, 15)


def ref_encode(x, table, nan_code):
    """RN-even, saturating encode by nearest-value search over the finite magnitudes."""
    with np.errstate(invalid="ignore"):
        x = np.asarray(x, np.float64)
    half = len(table) // 2
    mags = table[:half]
    finite = np.isfinite(mags)
    codes = np.nonzero(finite)[0]
    mags = mags[finite]                                   # ascending, code order
    a = np.abs(np.where(np.isnan(x), 0, x))
    a = np.minimum(a, mags[-1])                           # saturate (inf too)
    hi = np.clip(np.searchsorted(mags, a), 0, len(mags) - 1)
    lo = np.clip(hi - 1, 0, None)
    dlo, dhi = a - mags[lo], mags[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0) & (hi != lo))
    c = np.where(pick_hi, codes[hi], codes[lo])
    c = c | (np.signbit(x).astype(np.int64) << int(np.log2(half)))
    return np.where(np.isnan(x), nan_code, c).astype(np.uint8)


def ref_e8m0(x, mode):
    """Positive finite x -> E8M0 byte by float64 log2 arithmetic (below 2^-127 nothing is
    representable: rn/rz give 2^-127, rp gives 2^-127 too as the next value up)."""
    x = np.asarray(x, np.float64)
    lo = np.floor(np.log2(x))
    if mode == "rz":
        e = lo
    elif mode == "rp":
        e = np.where(2.0 ** lo == x, lo, lo + 1)
    else:
        e = np.where(x >= 1.5 * 2.0 ** lo, lo + 1, lo)
    return np.clip(e + 127, 0, 254).astype(np.uint8)


ML_DTYPES_VERSION = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2])


ALL_BF16 = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
FINITE = np.isfinite(ALL_BF16)
NAN = np.isnan(ALL_BF16)


def _np(a):
    return np.asarray(jax.device_get(a))


def _ml(x, dt):
    with np.errstate(all="ignore"):
        return np.asarray(x, np.float32).astype(dt).view(np.uint8)


def _random_f32(n, seed=0):
    """Random float32 bit patterns (all exponents, full mantissas), non-NaN."""
    b = np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    f = b.view(np.float32)
    return f[~np.isnan(f)]


# ------------------------------------------------------------------ E2M1
def test_e2m1_every_code_decodes():
    want = [0, .5, 1, 1.5, 2, 3, 4, 6]
    got = _np(F.e2m1_decode(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got[:8], want)
    np.testing.assert_array_equal(got[8:], -np.array(want))
    assert np.signbit(got[8]) and not np.signbit(got[0])
    np.testing.assert_array_equal(got, np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
                                  .astype(np.float32))
    np.testing.assert_array_equal(got, E2M1_REF.astype(np.float32))
    # every code survives encode(decode(code))
    np.testing.assert_array_equal(_np(F.e2m1_encode(got)), np.arange(16))


def test_e2m1_ties_round_to_even():
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    x = np.array(list(ties), np.float32)
    got = _np(F.e2m1_decode(F.e2m1_encode(x)))
    np.testing.assert_array_equal(got, list(ties.values()))
    np.testing.assert_array_equal(_np(F.e2m1_decode(F.e2m1_encode(-x))), -np.array(list(ties.values())))
    np.testing.assert_array_equal(_np(F.e2m1_encode(x)), _ml(x, ml_dtypes.float4_e2m1fn))


def test_e2m1_both_sides_of_every_boundary():
    vals = np.array(F.E2M1_VALUES)
    for j, t in enumerate(F.E2M1_BOUNDARIES):
        t = np.float32(t)
        below, above = np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(10))
        for sgn in (1, -1):
            got = _np(F.e2m1_decode(F.e2m1_encode(np.array([sgn * below, sgn * above], np.float32))))
            assert got[0] == sgn * vals[j] and got[1] == sgn * vals[j + 1], (t, sgn, got)


def test_e2m1_saturation_and_signed_zero():
    x = np.array([6.0, 6.5, 7.0, 1e30, np.inf, -6.5, -np.inf, 3.4e38], np.float32)
    np.testing.assert_array_equal(_np(F.e2m1_decode(F.e2m1_encode(x))), [6, 6, 6, 6, 6, -6, -6, 6])
    z = np.array([0.0, -0.0, -1e-30, -0.2, 1e-45, -1e-45], np.float32)
    np.testing.assert_array_equal(_np(F.e2m1_encode(z)), [0, 8, 8, 8, 0, 8])
    # .relu folds max(0, .) into the convert: negatives and -0 become +0
    np.testing.assert_array_equal(_np(F.e2m1_encode(np.array([-3.0, -0.0, 2.4], np.float32),
                                                    relu=True)), [0, 0, 4])


def test_e2m1_all_bf16_against_ml_dtypes_and_reference():
    ours = _np(F.e2m1_encode(ALL_BF16))
    np.testing.assert_array_equal(ours[~NAN], _ml(ALL_BF16, ml_dtypes.float4_e2m1fn)[~NAN])
    np.testing.assert_array_equal(ours, ref_encode(ALL_BF16, E2M1_REF, F.E2M1_NAN_CODE))
    f = _random_f32(200_000)
    np.testing.assert_array_equal(_np(F.e2m1_encode(f)), _ml(f, ml_dtypes.float4_e2m1fn))


def test_e2m1_nan_rule():
    """Decided rule: NaN -> +6 (E2M1_NAN_CODE); ml_dtypes gives a signed zero instead."""
    nan = np.array([np.nan, -np.nan], np.float32)
    assert F.E2M1_NAN_CODE == 0x7
    np.testing.assert_array_equal(_np(F.e2m1_encode(nan)), [0x7, 0x7])
    assert set(_ml(nan, ml_dtypes.float4_e2m1fn).tolist()) <= {0x0, 0x8}   # the difference


def test_e2m1_bf16_and_f16_inputs():
    x = jnp.array([0.75, 2.5, -5.0, 7.0], jnp.bfloat16)
    np.testing.assert_array_equal(_np(F.e2m1_encode(x)), [2, 4, 14, 7])
    np.testing.assert_array_equal(_np(F.e2m1_encode(x.astype(jnp.float16))), [2, 4, 14, 7])


# ------------------------------------------------------------------ E4M3 / E5M2
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_every_code(fmt):
    dec = {"e4m3": F.e4m3_decode, "e5m2": F.e5m2_decode}[fmt]
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    ref = {"e4m3": E4M3_REF, "e5m2": E5M2_REF}[fmt]
    got = _np(dec(jnp.arange(256, dtype=jnp.uint8)))
    ml = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ml))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(got)], ml.view(np.uint32)[~np.isnan(ml)])
    np.testing.assert_array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


def test_e4m3_constants():
    d = _np(F.e4m3_decode(jnp.array([0x7E, 0x01, 0x08, 0x7F], jnp.uint8)))
    assert d[0] == 448 and d[1] == 2.0 ** -9 and d[2] == 2.0 ** -6 and np.isnan(d[3])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_all_bf16(fmt):
    enc = {"e4m3": F.e4m3_encode, "e5m2": F.e5m2_encode}[fmt]
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    table, nan_code, fmax = {"e4m3": (E4M3_REF, 0x7F, 448.0),
                             "e5m2": (E5M2_REF, 0x7F, 57344.0)}[fmt]
    ml = _ml(ALL_BF16, dt)
    sat = _np(enc(ALL_BF16))
    # satfinite encode == independent reference everywhere (NaN -> canonical 0x7F)
    np.testing.assert_array_equal(sat, ref_encode(ALL_BF16, table, nan_code))
    # == ml_dtypes wherever ml_dtypes does not overflow (it returns NaN/inf there, we clamp)
    ml_val = ml.view(dt).astype(np.float32)
    in_range = FINITE & np.isfinite(ml_val)
    np.testing.assert_array_equal(sat[in_range], ml[in_range])
    over = FINITE & ~np.isfinite(ml_val)
    assert over.any()
    np.testing.assert_array_equal(_np(F.e4m3_decode(sat[over]) if fmt == "e4m3" else
                                      F.e5m2_decode(sat[over])), np.sign(ALL_BF16[over]) * fmax)
    # saturate=False reproduces ml_dtypes on every non-NaN input (inf and overflow included)
    nosat = _np(enc(ALL_BF16, saturate=False))
    np.testing.assert_array_equal(nosat[~NAN], ml[~NAN])
    np.testing.assert_array_equal(sat[NAN], nan_code)
    f = _random_f32(200_000, seed=1)
    fin = np.isfinite(f) & (np.abs(f) <= fmax)
    np.testing.assert_array_equal(_np(enc(f))[fin], _ml(f, dt)[fin])


def test_e4m3_overflow_boundary_and_specials():
    x = np.array([448, 464, np.nextafter(np.float32(464), np.float32(1e9)), 1e6, np.inf, -np.inf,
                  np.nan, -np.nan, 2.0 ** -10, 3 * 2.0 ** -11, -0.0], np.float32)
    got = _np(F.e4m3_encode(x))
    np.testing.assert_array_equal(got, [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0, 1, 0x80])


# ------------------------------------------------------------------ E8M0
def test_e8m0_decode_every_byte():
    got = _np(F.e8m0_decode(jnp.arange(256, dtype=jnp.uint8)))
    ml = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[:255], ml.view(np.uint32)[:255])
    assert np.isnan(got[255]) and np.isnan(ml[255])
    np.testing.assert_array_equal(got[1:255].astype(np.float64), 2.0 ** (np.arange(1, 255) - 127.0))


def test_e8m0_all_bf16_against_ml_dtypes():
    ml = _ml(ALL_BF16, ml_dtypes.float8_e8m0fnu)
    nosat = _np(F.e8m0_encode(ALL_BF16, saturate=False))
    # ml_dtypes 0.6 rounds float32-subnormal inputs (< 2^-126) in (2^-127, 1.5 * 2^-127) up to
    # 2^-126; 0.7 rounds them to the nearest (2^-127), as the reference below does
    check = ~NAN if ML_DTYPES_VERSION >= (0, 7) else ~NAN & ~((ALL_BF16 > 0) & (ALL_BF16 < 2.0 ** -126))
    np.testing.assert_array_equal(nosat[check], ml[check])
    assert (nosat[NAN] == 0xFF).all()
    pos = FINITE & (ALL_BF16 > 0)
    for mode in ("rn", "rz", "rp"):
        got = _np(F.e8m0_encode(ALL_BF16, mode=mode))
        np.testing.assert_array_equal(got[pos], ref_e8m0(ALL_BF16[pos], mode), mode)
    # decided satfinite rule: 0/negative -> 0x00, +inf/overflow -> 0xFE, NaN -> 0xFF
    x = np.array([0.0, -0.0, -2.0, np.inf, 3e38, np.nan, 3.0, 1.5, 2.0 ** -130], np.float32)
    np.testing.assert_array_equal(_np(F.e8m0_encode(x)), [0, 0, 0, 254, 254, 255, 129, 128, 0])
    np.testing.assert_array_equal(_ml(x, ml_dtypes.float8_e8m0fnu), [255, 255, 255, 255, 255, 255,
                                                                     129, 128, 0])
    np.testing.assert_array_equal(_np(F.e8m0_encode(np.float32(3.0), mode="rz")), 128)
    np.testing.assert_array_equal(_np(F.e8m0_encode(np.float32(2.0), mode="rp")), 128)
    np.testing.assert_array_equal(_np(F.e8m0_encode(np.float32(2.5), mode="rp")), 129)


# ------------------------------------------------------------------ packing
def test_pack_order():
    codes = jnp.array([0x1, 0x2, 0x3, 0x4, 0xF, 0x0], jnp.uint8)
    np.testing.assert_array_equal(_np(F.pack_e2m1(codes)), [0x21, 0x43, 0x0F])
    # a little-endian u32 holds 8 consecutive elements in order, element 0 in the low nibble
    c8 = jnp.arange(8, dtype=jnp.uint8)
    word = _np(F.pack_e2m1(c8)).view("<u4")[0]
    assert word == 0x76543210
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (3, 64, 10), dtype=np.uint8)
    for axis in (-1, 1):
        p = F.pack_e2m1(x, axis=axis)
        assert p.shape[axis] == x.shape[axis] // 2
        np.testing.assert_array_equal(_np(F.unpack_e2m1(p, axis=axis)), x)
    with pytest.raises(ValueError):
        F.pack_e2m1(jnp.zeros((3,), jnp.uint8))


# ------------------------------------------------------------------ NVFP4
def ref_nvfp4(x, G):
    """float32 NumPy NVFP4 following the documented formula, with the reference encoders."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[:-1] + (-1, 16))
    G = np.float32(G)
    amax = np.abs(xb).max(-1, keepdims=True)
    s = ref_encode(amax * (G * np.float32(1.0 / 6.0)), E4M3_REF, 0x7F)
    s_hat = E4M3_REF[s].astype(np.float32)
    ok = s_hat > 0
    inv = G / np.where(ok, s_hat, np.float32(1))
    codes = np.where(ok, ref_encode(xb * inv, E2M1_REF, 7), 0).astype(np.uint8)
    deq = (E2M1_REF[codes].astype(np.float32) * s_hat) * (np.float32(1) / G)
    return codes.reshape(x.shape), s[..., 0], deq.reshape(x.shape).astype(np.float32)


def test_nvfp4_bit_exact_against_reference():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 256)) * np.exp(rng.uniform(-6, 6, (8, 1)))).astype(np.float32)
    t = jax.jit(F.nvfp4_quantize)(x)
    G = (448.0 * 6.0) / np.abs(x).max()
    np.testing.assert_allclose(_np(t.global_scale), G, rtol=1e-7)
    G = _np(t.global_scale).reshape(())
    codes, s, deq = ref_nvfp4(x, G)
    np.testing.assert_array_equal(_np(t.codes), codes)
    np.testing.assert_array_equal(_np(t.scales), s)
    np.testing.assert_array_equal(_np(F.nvfp4_dequantize(t)), deq)
    assert _np(t.scales).max() == 0x7E        # the tensor's max block uses the top scale (448)
    rel = np.linalg.norm(deq - x) / np.linalg.norm(x)
    assert rel < 0.15


def test_nvfp4_zero_scale_and_all_zero_blocks():
    x = np.zeros((2, 64), np.float32)
    x[0, 16:32] = np.linspace(-1, 1, 16)
    x[1, :16] = 1e-3
    t = F.nvfp4_quantize(x, global_scale=1.0)          # 1e-3/6 * 1 rounds to a zero E4M3 scale
    s, c, d = _np(t.scales), _np(t.codes), _np(F.nvfp4_dequantize(t))
    assert s[1, 0] == 0 and (c[1, :16] == 0).all() and (d[1] == 0).all()      # block vanishes
    assert s[0, 0] == 0 and (c[0, :16] == 0).all() and (d[0, :16] == 0).all()  # all-zero block
    assert np.isfinite(d).all() and s[0, 1] != 0
    z = F.nvfp4_quantize(np.zeros((1, 32), np.float32))
    assert float(z.global_scale.reshape(())) == 1.0 and not np.asarray(F.nvfp4_dequantize(z)).any()


def test_nvfp4_global_factor_matters_for_p():
    """Paper section 1: P rows (S=4096) in NVFP4 with G=1 lose most blocks to zero E4M3 scales;
    G=448 keeps them all."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((16, 4096)).astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    frac = {G: float((_np(F.nvfp4_quantize(p, G).scales) == 0).mean()) for G in (1.0, 448.0)}
    assert frac[1.0] > 0.95 and frac[448.0] == 0.0, frac


def test_nvfp4_per_head_global_axes():
    x = np.stack([np.full((4, 32), 1.0), np.full((4, 32), 100.0)]).astype(np.float32)
    t = F.nvfp4_quantize(x, global_axes=(1, 2))
    assert t.global_scale.shape == (2, 1, 1)
    np.testing.assert_array_equal(_np(F.nvfp4_dequantize(t)), x)


# ------------------------------------------------------------------ MXFP4
def ref_mxfp4(x, rule):
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float64)
    amax = np.abs(xb).max(-1, keepdims=True)
    fl = np.floor(np.log2(np.where(amax > 0, amax, 1.0)))
    e = fl - 2 if rule == "ocp" else np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0))
    u = np.clip(e + 127, 0, 254)
    codes = ref_encode(xb / 2.0 ** (u - 127), E2M1_REF, 7)
    codes = np.where(amax > 0, codes, 0).astype(np.uint8)
    u = np.where(amax > 0, u, 0).astype(np.uint8)
    deq = E2M1_REF[codes] * 2.0 ** (u.astype(np.float64) - 127)
    return codes.reshape(x.shape), u[..., 0], deq.reshape(x.shape)


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_mxfp4_bit_exact_against_reference(rule):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 128)) * np.exp2(rng.integers(-100, 100, (16, 1)))).astype(np.float32)
    x[3, 32:64] = 0.0                                     # an all-zero block
    t = jax.jit(lambda a: F.mxfp4_quantize(a, rule=rule))(x)
    codes, u, deq = ref_mxfp4(x, rule)
    np.testing.assert_array_equal(_np(t.codes), codes)
    np.testing.assert_array_equal(_np(t.scales), u)
    np.testing.assert_array_equal(_np(F.mxfp4_dequantize(t)), deq.astype(np.float32))
    assert _np(t.scales)[3, 1] == 0 and not _np(t.codes)[3, 32:64].any()
    if rule == "ceil":   # no element saturates: every |x| / 2^e <= 6
        scaled = np.abs(x.reshape(16, 4, 32)) / 2.0 ** (u[..., None].astype(np.float64) - 127)
        assert scaled.max() <= 6.0
    # OCP: the block max lands in [4, 8) before the E2M1 convert
    if rule == "ocp":
        amax = np.abs(x.reshape(16, 4, 32)).max(-1)
        r = amax / 2.0 ** (u.astype(np.float64) - 127)
        assert ((r >= 4) & (r < 8))[amax > 0].all()


def test_mxfp4_block_at_scale_byte_one_and_nan_block():
    x = np.zeros((2, 32), np.float32)
    x[0] = np.float32(2.0 ** -126) * np.array([6, 4, 3, 2, 1.5, 1] * 5 + [-6, 0], np.float32)
    x[1, 5] = np.nan
    t = F.mxfp4_quantize(x * np.float32(1.0))   # OCP: amax = 6 * 2^-126 -> e = -126 -> u = 1
    assert int(_np(t.scales)[0, 0]) == 1
    d = _np(F.mxfp4_dequantize(t))
    np.testing.assert_array_equal(d[0], x[0])    # every value >= 2^-126: nothing flushed
    assert int(_np(t.scales)[1, 0]) == 0xFF and np.isnan(d[1]).all()


def test_fake_quant_fp8_per_tensor():
    x = np.array([[1e-3, 0.5, -2.0, 0.0]], np.float32)
    y = _np(F.fake_quant_fp8(x, "e4m3"))
    np.testing.assert_allclose(y, x, rtol=2 ** -4)
    assert y[0, 2] == -2.0


@pytest.mark.parametrize("shape", [(4, 96), (1, 1, 32, 128)])
def test_nan_block_scale_does_not_depend_on_the_reduce(shape):
    """A block holding a NaN gets the NaN scale (MXFP4 E8M0 0xFF; NVFP4 E4M3 NaN) for every
    shape: XLA:CPU's vectorized max-reduce drops the NaN for some (such as V's [1, 1, 32, 128]
    view), so the NaN is found explicitly."""
    x = np.full(shape, 0.3, np.float32)
    x.reshape(-1, shape[-1])[-1, 2] = np.nan
    mx = F.mxfp4_quantize(x)
    assert np.asarray(mx.scales).reshape(-1, shape[-1] // 32)[-1, 0] == 0xFF
    assert np.all(np.isnan(np.asarray(F.mxfp4_dequantize(mx)).reshape(-1, shape[-1])[-1, :32]))
    nv = F.nvfp4_dequantize(F.nvfp4_quantize(x))
    assert np.all(np.isnan(np.asarray(nv).reshape(-1, shape[-1])[-1, :16]))
