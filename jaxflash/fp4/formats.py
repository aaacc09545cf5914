"""FP4/FP8 number formats for the Blackwell block-scaled path, in plain JAX (jit-able, any device).

Codes are ``uint8`` arrays holding one element per byte (``pack_e2m1`` packs two E2M1 codes per
byte).  Every encoder works on the float32 bit pattern with integer arithmetic, so results do not
depend on the platform's subnormal handling (XLA:CPU flushes float32 subnormals to zero in
arithmetic; the encoders never do arithmetic on the input value).

Formats
-------
* **E2M1** (``float4_e2m1fn``): 1 sign, 2 exponent (bias 1), 1 mantissa bit; magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no inf, no NaN.
* **E4M3** (``float8_e4m3fn``): bias 7, max 448, subnormal step 2^-9, NaN = S.1111.111, no inf.
* **E5M2** (``float8_e5m2``): bias 15, max 57344, IEEE-style inf/NaN (used for dO in training).
* **E8M0** (``float8_e8m0fnu``): unsigned power of two 2^(u-127), u in 0..254; 0xFF = NaN; no zero.

Rounding and the rules decided where ml_dtypes and the hardware differ
----------------------------------------------------------------------
Encoders round to nearest, ties to even, and (``saturate=True``, the default) behave like the PTX
``cvt.rn.satfinite`` conversions the kernel uses: finite values beyond the largest finite value
and +-inf clamp to +-max.  Where that differs from ml_dtypes (0.7.0) the rule is:

============  =======================  ==============================  ==========================
format        input                    ml_dtypes                       this module (default)
============  =======================  ==============================  ==========================
E2M1          NaN                      +-0 (sign flipped)              ``E2M1_NAN_CODE`` = +6 (0x7)
E4M3          |x| > 464 or +-inf       NaN                             +-448 (satfinite)
E4M3          NaN (either sign)        sign-preserving NaN             0x7F (canonical NaN)
E5M2          |x| >= 61440 or +-inf    +-inf                           +-57344 (satfinite)
E5M2          NaN                      NaN                             0x7F (canonical NaN)
E8M0 (rn)     0, negative              NaN (0xFF)                      0x00 (2^-127: "zero scale")
E8M0 (rn)     +inf, overflow           NaN (0xFF)                      0xFE (2^127, satfinite)
============  =======================  ==============================  ==========================

With ``saturate=False`` the E4M3/E5M2/E8M0 encoders reproduce ml_dtypes for non-NaN inputs
(overflow -> NaN/inf, E8M0 of 0 or a negative -> NaN).  The E2M1 NaN rule is PROVISIONAL: the
NaN behaviour of ``cvt.rn.satfinite.e2m1x2.f32`` has not been observed on sm_100a hardware (see
the design brief, section 1); +6 (positive MAX_NORM) was chosen so that a NaN never turns into a
silent zero.  Change ``E2M1_NAN_CODE`` once a GPU check pins it.

E8M0 rounding: ml_dtypes rounds to nearest with ties *up* (1.5 -> 2, 3 -> 4: with no mantissa the
tie goes to the larger power of two); the hardware converter ``cvt.{rz,rp}.satfinite.ue8m0x2``
only offers toward-zero and toward-+inf.  ``e8m0_encode(x, mode=...)`` offers all three.

Block formats
-------------
* **NVFP4**: blocks of 16 along the last axis, E4M3 block scale, float32 global encode factor G.
  ``s = E4M3(amax_B * (G * f32(1/6)))``, ``code = E2M1(x * (G / s_hat))``,
  ``x_hat = (q * s_hat) * (1 / G)`` (float32, in that order: XLA rewrites a division by a
  broadcast or constant into a multiplication by its reciprocal, so the formulas are written
  with explicit reciprocals to stay bit-reproducible in NumPy).
  G defaults to 448*6/amax (amax over ``global_axes``; G = 1 for an all-zero tensor).  If the
  block scale rounds to zero (s_hat == 0, e.g. an all-zero block or G too small) the whole block
  is stored as +0 codes and dequantizes to 0 ("the block vanishes", as in the paper).
* **MXFP4**: blocks of 32 along the last axis, E8M0 scale.  ``rule="ocp"`` (OCP MX v1.0):
  shared exponent e = floor(log2 amax) - 2 (emax of E2M1), elements x / 2^e saturate at 6.
  ``rule="ceil"``: the smallest power-of-two scale with amax / 2^e <= 6 (no element saturates).
  The byte is u = clip(e + 127, 0, 254).  An all-zero block (or one whose amax is a float32
  subnormal) gets u = 0 and all-+0 codes: the paper's "u_B = 0 is a zero block".  A block holding
  a NaN or inf gets the NaN scale 0xFF (it decodes to NaN).  Dequantize is q * 2^(u-127); values
  below 2^-126 follow the platform's subnormal handling (XLA:CPU flushes them to zero).

Nibble packing (``pack_e2m1``): element 2i goes to the LOW nibble of byte i, element 2i+1 to the
high nibble, i.e. byte = code[2i] | code[2i+1] << 4.  This is what ``cvt.rn.satfinite.e2m1x2.f32
d, a, b`` produces when called as (a, b) = (x[2i+1], x[2i]) (PTX puts a in the upper half), which
is how HAO's ``packed_float_to_e2m1`` calls it, so a little-endian u32 holds 8 elements in order.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash.fp4 import constants as _C

__all__ = [
    "E2M1_VALUES", "E2M1_BOUNDARIES", "E2M1_MAX", "E4M3_MAX", "E5M2_MAX", "E2M1_NAN_CODE",
    "E4M3_NAN_CODE", "E5M2_NAN_CODE", "E8M0_NAN", "E8M0_BIAS", "NVFP4_BLOCK", "MXFP4_BLOCK",
    "e2m1_encode", "e2m1_decode", "e4m3_encode", "e4m3_decode", "e5m2_encode", "e5m2_decode",
    "e8m0_encode", "e8m0_decode", "pack_e2m1", "unpack_e2m1",
    "NVFP4", "MXFP4", "nvfp4_global_scale", "nvfp4_quantize", "nvfp4_dequantize", "mxfp4_quantize",
    "mxfp4_dequantize", "fake_quant_nvfp4", "fake_quant_mxfp4", "fake_quant_fp8",
]

E2M1_VALUES = _C.E2M1_VALUES           # (the table the kernel's code sum uses too)
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # RN decision points between codes
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_NAN_CODE = 0x7   # decided (provisional, see module doc): NaN -> +6
E4M3_NAN_CODE = 0x7F
E5M2_NAN_CODE = 0x7F
E8M0_NAN = 0xFF
E8M0_BIAS = 127
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
_SIXTH = float(np.float32(1.0 / 6.0))


class _Spec(NamedTuple):
    ebits: int
    mbits: int
    bias: int
    max_code: int       # largest finite magnitude code
    overflow_code: int  # magnitude code of an overflow when not saturating (NaN or inf)
    nan_code: int       # code written for a NaN input (sign bit clear)


_E2M1 = _Spec(2, 1, 1, 0x7, 0x7, E2M1_NAN_CODE)
_E4M3 = _Spec(4, 3, 7, 0x7E, 0x7F, E4M3_NAN_CODE)
_E5M2 = _Spec(5, 2, 15, 0x7B, 0x7C, E5M2_NAN_CODE)


def _decode_table(spec: _Spec) -> np.ndarray:
    """Value of every code, from the bit definition (NaN codes -> NaN, inf codes -> inf)."""
    nbits = 1 + spec.ebits + spec.mbits
    out = np.empty(1 << nbits, np.float32)
    for c in range(1 << nbits):
        s = (c >> (spec.ebits + spec.mbits)) & 1
        E = (c >> spec.mbits) & ((1 << spec.ebits) - 1)
        m = c & ((1 << spec.mbits) - 1)
        mag_code = c & ((1 << (spec.ebits + spec.mbits)) - 1)
        if mag_code > spec.max_code:
            val = np.inf if (spec is _E5M2 and m == 0) else np.nan
        elif E == 0:
            val = 2.0 ** (1 - spec.bias) * m / (1 << spec.mbits)
        else:
            val = 2.0 ** (E - spec.bias) * (1 + m / (1 << spec.mbits))
        out[c] = -val if s else val
    return out


_TABLES = {id(s): _decode_table(s) for s in (_E2M1, _E4M3, _E5M2)}


def amax_abs(x, axis) -> jax.Array:
    """max |x| over `axis` (kept), NaN where the slice holds a NaN. Said explicitly: XLA:CPU's
    vectorized max-reduce was seen to drop a NaN for some shapes, and the formats' NaN rules
    (a NaN block's scale) must not depend on that."""
    m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis, keepdims=True), jnp.nan, m)


def _f32_bits(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    # The barrier keeps XLA from constant-folding the encoders: its folding of this integer
    # arithmetic on a transposed constant (K / V closed over by a jitted caller) gave wrong
    # codes, while the same program on arguments is right. No run-time cost.
    x = lax.optimization_barrier(x.astype(jnp.float32))
    return lax.bitcast_convert_type(x, jnp.uint32)  # exact widening


def _encode(x, spec: _Spec, saturate: bool, relu: bool = False) -> jax.Array:
    """Round-to-nearest-even minifloat encode from the float32 bits, integer arithmetic only."""
    bits = _f32_bits(x)
    sign = (bits >> 31).astype(jnp.int32)
    E = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = (bits & 0x7FFFFF).astype(jnp.int32)
    is_nan = (E == 255) & (frac != 0)
    sig = jnp.where(E > 0, frac | 0x800000, frac)           # value = sig * 2^(max(E,1) - 150)
    e_unb = jnp.maximum(E, 1) - 127                          # exponent of the leading bit (normal)
    emin = 1 - spec.bias
    qexp = jnp.maximum(e_unb, emin) - spec.mbits             # quantum of the target binade
    shift = 150 + qexp - jnp.maximum(E, 1)                  # >= 23 - mbits > 0
    s = jnp.clip(shift, 1, 31)
    q = sig >> s
    rem = sig & ((1 << s) - 1)
    half = 1 << (s - 1)
    n = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    n = jnp.where(shift > 25, 0, n)                          # sig < 2^24: below half a quantum
    top = 1 << (spec.mbits + 1)
    carry = n == top
    n2 = jnp.where(carry, n >> 1, n)
    qe2 = jnp.where(carry, qexp + 1, qexp)
    normal = n2 >= (1 << spec.mbits)
    field = jnp.where(normal, qe2 + spec.mbits + spec.bias, 0)
    mant = jnp.where(normal, n2 - (1 << spec.mbits), n2)
    mag = (jnp.minimum(field, 1 << 12) << spec.mbits) | mant  # clamp keeps int32 safe for inf
    over = mag > spec.max_code
    mag = jnp.where(over, spec.max_code if saturate else spec.overflow_code, mag)
    code = mag | (sign << (spec.ebits + spec.mbits))
    if relu:
        code = jnp.where(sign == 1, 0, code)
    code = jnp.where(is_nan, spec.nan_code, code)
    return code.astype(jnp.uint8)


def _decode(code, spec: _Spec) -> jax.Array:
    table = jnp.asarray(_TABLES[id(spec)])
    nbits = 1 + spec.ebits + spec.mbits
    return jnp.take(table, jnp.asarray(code).astype(jnp.int32) & ((1 << nbits) - 1))


@functools.partial(jax.jit, static_argnames=('relu',))
def e2m1_encode(x, *, relu: bool = False) -> jax.Array:
    """float -> E2M1 code (0..15, sign in bit 3), RN-even, saturating at +-6 (like
    ``cvt.rn.satfinite{.relu}.e2m1x2.f32``).  ``relu=True`` maps negatives (and -0) to +0.
    NaN -> ``E2M1_NAN_CODE`` (decided rule, see module doc)."""
    return _encode(x, _E2M1, True, relu)


@jax.jit
def e2m1_decode(code) -> jax.Array:
    """E2M1 code -> float32 (code 8 is -0.0)."""
    return _decode(code, _E2M1)


@functools.partial(jax.jit, static_argnames=('saturate',))
def e4m3_encode(x, *, saturate: bool = True) -> jax.Array:
    """float -> E4M3 (float8_e4m3fn) byte, RN-even.  ``saturate`` clamps overflow and inf to
    +-448 (satfinite); NaN -> 0x7F."""
    return _encode(x, _E4M3, saturate)


@jax.jit
def e4m3_decode(code) -> jax.Array:
    return _decode(code, _E4M3)


@functools.partial(jax.jit, static_argnames=('saturate',))
def e5m2_encode(x, *, saturate: bool = True) -> jax.Array:
    """float -> E5M2 byte, RN-even, satfinite (+-57344) by default; NaN -> 0x7F."""
    return _encode(x, _E5M2, saturate)


@jax.jit
def e5m2_decode(code) -> jax.Array:
    return _decode(code, _E5M2)


@functools.partial(jax.jit, static_argnames=('mode', 'saturate'))
def e8m0_encode(x, *, mode: str = "rn", saturate: bool = True) -> jax.Array:
    """float -> E8M0 byte u (value 2^(u-127)).

    mode: "rn" nearest, ties up (= ml_dtypes); "rz" toward zero (floor of the exponent);
    "rp" toward +inf (ceil) -- the two modes of ``cvt.{rz,rp}.satfinite.ue8m0x2.f32``.
    NaN -> 0xFF.  With ``saturate`` (default): +inf and overflow -> 0xFE, zero, negatives and
    values below the range -> 0x00.  Without: those give 0xFF as in ml_dtypes."""
    if mode not in ("rn", "rz", "rp"):
        raise ValueError(f"mode must be 'rn', 'rz' or 'rp', got {mode!r}")
    bits = _f32_bits(x)
    neg = (bits >> 31) == 1
    E = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = (bits & 0x7FFFFF).astype(jnp.int32)
    is_nan = (E == 255) & (frac != 0)
    is_inf = (E == 255) & (frac == 0)
    zero = (E == 0) & (frac == 0)
    if mode == "rn":
        up_n = frac >= 0x400000          # >= 1.5 * 2^e: ties go up
        up_s = frac >= 0x600000          # subnormal: >= 1.5 * 2^-127 -> 2^-126
    elif mode == "rz":
        up_n = jnp.zeros_like(frac, bool)
        up_s = frac >= 0x800000          # never
    else:
        up_n = frac != 0
        up_s = frac > 0x400000           # above 2^-127 -> 2^-126
    u = jnp.where(E > 0, E + up_n.astype(jnp.int32), up_s.astype(jnp.int32))
    over = (u > 254) | is_inf
    bad_low = zero | neg
    if saturate:
        u = jnp.where(over, 254, u)
        u = jnp.where(bad_low, 0, u)
    else:
        u = jnp.where(over | bad_low, E8M0_NAN, u)
    u = jnp.where(is_nan, E8M0_NAN, u)
    return u.astype(jnp.uint8)


@jax.jit
def e8m0_decode(u) -> jax.Array:
    """E8M0 byte -> float32 2^(u-127), built from bits (u = 0 gives the subnormal 2^-127, which
    XLA:CPU arithmetic flushes to zero); 0xFF -> NaN."""
    u = jnp.asarray(u).astype(jnp.uint32)
    b = jnp.where(u == 0, jnp.uint32(0x400000), u << 23)
    b = jnp.where(u == 255, jnp.uint32(0x7FC00000), b)
    return lax.bitcast_convert_type(b, jnp.float32)


def _pow2(e) -> jax.Array:
    """Exact float32 2^e for integer e in [-126, 127] (from bits)."""
    e = jnp.asarray(e, jnp.int32)
    return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.uint32), jnp.float32)


# ------------------------------------------------------------------------- nibble packing
@functools.partial(jax.jit, static_argnames=('axis',))
def pack_e2m1(codes, axis: int = -1) -> jax.Array:
    """Two E2M1 codes per byte along ``axis`` (even length): byte i = c[2i] | c[2i+1] << 4."""
    c = jnp.moveaxis(jnp.asarray(codes).astype(jnp.uint8) & 0xF, axis, -1)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even length, got {c.shape[-1]}")
    out = c[..., 0::2] | (c[..., 1::2] << 4)
    return jnp.moveaxis(out, -1, axis)


@functools.partial(jax.jit, static_argnames=('axis',))
def unpack_e2m1(packed, axis: int = -1) -> jax.Array:
    """Inverse of ``pack_e2m1``."""
    p = jnp.moveaxis(jnp.asarray(packed).astype(jnp.uint8), axis, -1)
    out = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))
    return jnp.moveaxis(out, -1, axis)


# ------------------------------------------------------------------------- block formats
class NVFP4(NamedTuple):
    """codes: uint8 [..., n] E2M1; scales: uint8 [..., n/16] E4M3 bytes; global_scale: float32
    broadcastable to [..., 1] (the encode factor G: x_hat = q * s_hat / G)."""
    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array


class MXFP4(NamedTuple):
    """codes: uint8 [..., n] E2M1; scales: uint8 [..., n/32] E8M0 bytes (x_hat = q * 2^(u-127))."""
    codes: jax.Array
    scales: jax.Array


def _blocks(x, block: int):
    x = jnp.asarray(x)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last axis ({n}) must be a multiple of the block size {block}")
    return x.astype(jnp.float32).reshape(x.shape[:-1] + (n // block, block))


@functools.partial(jax.jit, static_argnames=('axes',))
def nvfp4_global_scale(x, axes: Optional[Union[int, Sequence[int]]] = None) -> jax.Array:
    """G = 448 * 6 / amax(x) over ``axes`` (all by default; kept as size-1 dims); 1 where amax = 0."""
    amax = amax_abs(jnp.asarray(x).astype(jnp.float32), axes)
    return jnp.where(amax > 0, (E4M3_MAX * E2M1_MAX) / jnp.where(amax > 0, amax, 1.0), 1.0)


@functools.partial(jax.jit, static_argnames=('global_axes',))
def nvfp4_quantize(x, global_scale=None, *, global_axes=None) -> NVFP4:
    """NVFP4: blocks of 16 along the last axis, E4M3 block scales, float32 global factor G."""
    xb = _blocks(x, NVFP4_BLOCK)
    if global_scale is None:
        global_scale = nvfp4_global_scale(x, global_axes)
    G = jnp.asarray(global_scale, jnp.float32)
    Gb = G[..., None] if G.ndim == xb.ndim - 1 else G  # [..., 1] -> [..., 1, 1]
    amax = amax_abs(xb, -1)
    s = e4m3_encode(amax * (Gb * _SIXTH))
    s_hat = e4m3_decode(s)
    ok = s_hat > 0
    inv = Gb / jnp.where(ok, s_hat, 1.0)
    codes = jnp.where(ok, e2m1_encode(xb * inv), jnp.uint8(0))
    return NVFP4(codes.reshape(jnp.shape(x)), s[..., 0], G)


@functools.partial(jax.jit, static_argnames=('dtype',))
def nvfp4_dequantize(t: NVFP4, dtype=jnp.float32) -> jax.Array:
    codes = jnp.asarray(t.codes)
    qb = e2m1_decode(codes).reshape(codes.shape[:-1] + (-1, NVFP4_BLOCK))
    s_hat = e4m3_decode(t.scales)[..., None]
    G = jnp.asarray(t.global_scale, jnp.float32)
    Gb = G[..., None] if G.ndim == qb.ndim - 1 else G
    return ((qb * s_hat) * (1.0 / Gb)).reshape(codes.shape).astype(dtype)


def _mx_exponent(amax, rule: str):
    """Shared exponent e from float32 amax >= 0 (bits only). Returns (e, zero_block, bad)."""
    bits = _f32_bits(amax)
    E = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = (bits & 0x7FFFFF).astype(jnp.int32)
    fl = E - 127                                   # floor(log2 amax) for normal amax
    if rule == "ocp":
        e = fl - 2
    elif rule == "ceil":
        e = jnp.where(frac <= 0x400000, fl - 2, fl - 1)  # amax <= 1.5 * 2^fl <=> amax/2^(fl-2) <= 6
    else:
        raise ValueError(f"rule must be 'ocp' or 'ceil', got {rule!r}")
    return e, E == 0, E == 255


@functools.partial(jax.jit, static_argnames=('rule',))
def mxfp4_quantize(x, *, rule: str = "ocp") -> MXFP4:
    """MXFP4: blocks of 32 along the last axis, E8M0 scale (see module doc for the rules)."""
    xb = _blocks(x, MXFP4_BLOCK)
    amax = amax_abs(xb, -1)
    e, zero, bad = _mx_exponent(amax, rule)
    u = jnp.clip(e + E8M0_BIAS, 0, 254)
    codes = e2m1_encode(xb * _pow2(-(u - E8M0_BIAS)))
    codes = jnp.where(zero, jnp.uint8(0), codes)
    u = jnp.where(zero, 0, u)
    u = jnp.where(bad, E8M0_NAN, u)
    return MXFP4(codes.reshape(jnp.shape(x)), u[..., 0].astype(jnp.uint8))


@functools.partial(jax.jit, static_argnames=('dtype',))
def mxfp4_dequantize(t: MXFP4, dtype=jnp.float32) -> jax.Array:
    codes = jnp.asarray(t.codes)
    qb = e2m1_decode(codes).reshape(codes.shape[:-1] + (-1, MXFP4_BLOCK))
    return (qb * e8m0_decode(t.scales)[..., None]).reshape(codes.shape).astype(dtype)


# ------------------------------------------------------------------------- fake quantization
def _along(fn, x, axis):
    x = jnp.moveaxis(jnp.asarray(x), axis, -1)
    return jnp.moveaxis(fn(x), -1, axis)


@functools.partial(jax.jit, static_argnames=('axis', 'global_axes'))
def fake_quant_nvfp4(x, *, axis: int = -1, global_axes=None, global_scale=None) -> jax.Array:
    """Quantize to NVFP4 along ``axis`` and back (float32)."""
    def f(y):
        ga = global_axes
        return nvfp4_dequantize(nvfp4_quantize(y, global_scale, global_axes=ga))
    return _along(f, x, axis)


@functools.partial(jax.jit, static_argnames=('axis', 'rule'))
def fake_quant_mxfp4(x, *, axis: int = -1, rule: str = "ocp") -> jax.Array:
    """Quantize to MXFP4 along ``axis`` and back (float32)."""
    return _along(lambda y: mxfp4_dequantize(mxfp4_quantize(y, rule=rule)), x, axis)


@functools.partial(jax.jit, static_argnames=('fmt', 'scale_axes'))
def fake_quant_fp8(x, fmt: str = "e4m3", *, scale_axes=None, scale=None) -> jax.Array:
    """Per-tensor (or per-``scale_axes``-slice) scaled FP8 round trip, float32:
    s = fmt_max / amax (1 for an all-zero slice) unless ``scale`` is given;
    x_hat = decode(encode(x * s)) * (1 / s)."""
    enc, dec, fmax = {"e4m3": (e4m3_encode, e4m3_decode, E4M3_MAX),
                      "e5m2": (e5m2_encode, e5m2_decode, E5M2_MAX)}[fmt]
    x = jnp.asarray(x).astype(jnp.float32)
    if scale is None:
        amax = amax_abs(x, scale_axes)
        scale = jnp.where(amax > 0, fmax / jnp.where(amax > 0, amax, 1.0), 1.0)
    return dec(enc(x * scale)) * (1.0 / scale)
