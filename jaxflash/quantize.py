"""FP8 quantization for attention operands, and the random-sign Hadamard transform.

Everything here is plain JAX (jit-able, any device) and is the one definition of the rules the
FP8 attention path and its kernels follow.

Layout. An operand is ``x [B..., L, heads, D]`` (jaxflash's query / key / value layout; L the
sequence). `quantize` returns ``(x8, scale)``: ``x8`` in ``float8_e4m3fn`` or ``float8_e5m2``
with x's shape, and ``scale`` float32 with one of three layouts (``granularity``):

- ``"tensor"``: shape ``()``: one scale for the whole array.
- ``"head"``:   shape ``[B..., heads]``: one per (batch row, head), over its L x D values.
- ``"block"``:  shape ``[B..., heads, ceil(L / block_size)]``: one per (batch row, head, block
  of ``block_size`` consecutive sequence rows x the whole head dim); the last block may be short.

Meaning: ``scale`` is the *dequantization* factor, ``x ~= x8.astype(float32) * scale`` with
the scale broadcast over its block (`dequantize`). It is not the softmax ``scale`` of
`jaxflash.flash_attention`.

Rules (the FP8 kernels follow them bit for bit when they quantize):

- ``amax = max |x|`` over the block, in float32. ``scale = amax * (1 / FMAX)`` (the float32
  reciprocal, `inverse_fmax`: XLA makes that product of ``amax / FMAX`` on every platform) and
  the values are encoded as ``x8 = satfinite_rne(x * (FMAX / amax))`` (FMAX = 448 for E4M3,
  57344 for E5M2; the division float32 round-to-nearest). So each block's largest value maps
  to FMAX.
- Saturation: values whose scaled magnitude exceeds FMAX (only possible by a rounding ulp, or
  with a caller's ``scale=``) clip to +-FMAX, never to NaN / Inf. E5M2's Inf is never produced.
- Zero blocks: ``amax == 0`` gives ``scale = 1`` and all-zero codes (no division by zero; a
  dequantized zero block is exactly zero). A caller's scale of 0 makes its block dequantize to 0.
- Tiny blocks: a nonzero amax below `AMAX_FLOOR` (2^-112) is raised to it, so ``FMAX / amax``
  stays finite (below about 1e-36 it would overflow and the block's zeros become NaN).
- Non-finite input: a block holding NaN or +-Inf has a NaN or Inf amax; it dequantizes to NaN
  (poisoned visibly, not silently clipped). Scales are not checked for sign or finiteness.
- Rounding is round-to-nearest-even (XLA's float32 -> float8 convert; ``cvt.rn.satfinite``
  on the GPU).

Hadamard. `hadamard(x, seed)` maps the last axis (the head dim, a power of two from 16 to 256)
through ``x -> (x * signs) @ H / sqrt(D)`` with H the Sylvester Walsh-Hadamard matrix and
``signs`` a random +-1 vector from `hadamard_signs(seed, D)`. The map is orthogonal, so applied
to both Q and K it cancels in ``Q K^T`` exactly (in exact arithmetic), while it spreads an
outlier channel over all D channels: what makes per-block FP8 scales tight (FlashAttention-3's
"incoherent processing"). `inverse_hadamard` undoes it.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

__all__ = ["FP8_DTYPES", "FP8_MAX", "GRANULARITIES", "quantize", "dequantize", "expand_scale",
           "scale_shape", "hadamard", "hadamard_signed", "inverse_hadamard", "hadamard_signs",
           "fwht", "saturating_cast", "is_fp8"]


# The least amax a nonzero block is quantized with: FMAX / AMAX_FLOOR is finite in float32 for
# E4M3 (448 * 2^112 ~ 2^120.8) and E5M2 (57344 * 2^112 ~ 2^127.8).
AMAX_FLOOR = 2.0 ** -112


def inverse_fmax(dtype) -> np.float32:
    """``1 / FMAX`` of an FP8 dtype, float32 round-to-nearest (the scale rule's factor)."""
    return np.float32(1.0) / np.float32(FP8_MAX[jnp.dtype(dtype)])

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}
GRANULARITIES = ("tensor", "head", "block")
HADAMARD_DIMS = (16, 32, 64, 128, 256)


def is_fp8(dtype) -> bool:
    """Whether `dtype` is one of the two FP8 formats the attention path takes."""
    return jnp.dtype(dtype) in FP8_DTYPES


def _fp8_dtype(dtype):
    d = jnp.dtype(dtype)
    if d not in FP8_DTYPES:
        raise ValueError(f"FP8 dtype must be float8_e4m3fn or float8_e5m2; got {d}")
    return d


def scale_shape(shape, granularity: str, block_size: int = 128) -> tuple[int, ...]:
    """The scale's shape for an operand of `shape` ``[B..., L, heads, D]`` (see module doc)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}; got {granularity!r}")
    if len(shape) < 3:
        raise ValueError(f"operand must be [B..., L, heads, D]; got shape {tuple(shape)}")
    if granularity == "tensor":
        return ()
    *batch, L, heads, _ = shape
    if granularity == "head":
        return tuple(batch) + (heads,)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    return tuple(batch) + (heads, -(-L // block_size))


def saturating_cast(x, dtype) -> jax.Array:
    """float32 -> FP8 with round-to-nearest-even and saturation to +-FMAX (NaN stays NaN)."""
    d = _fp8_dtype(dtype)
    m = FP8_MAX[d]
    return jnp.clip(x.astype(jnp.float32), -m, m).astype(d)


def _blocked(x, granularity: str, block_size: int):
    """x [B..., L, heads, D] float32 -> (view whose reduced axes hold one block each, axes)."""
    nb = x.ndim - 3
    if granularity == "tensor":
        return x, tuple(range(x.ndim))
    # Move heads before L: [B..., heads, L, D].
    xt = jnp.swapaxes(x, -3, -2)
    if granularity == "head":
        return xt, (nb + 1, nb + 2)
    L = x.shape[-3]
    n = -(-L // block_size)
    xt = jnp.pad(xt, [(0, 0)] * (nb + 1) + [(0, n * block_size - L), (0, 0)])
    xt = xt.reshape(xt.shape[:nb + 1] + (n, block_size, x.shape[-1]))
    return xt, (nb + 2, nb + 3)


def expand_scale(scale, shape, granularity: str, block_size: int = 128) -> jax.Array:
    """`scale` (in the layout of `granularity`) broadcast to a ``[B..., L, heads, 1]`` float32
    array that multiplies the codes of an operand of `shape`."""
    s = jnp.asarray(scale, jnp.float32)
    if granularity == "tensor":
        return s.reshape(())
    if granularity == "head":
        return s[..., None, :, None]                                  # [B..., 1, heads, 1]
    L = shape[-3]
    s = jnp.repeat(s, block_size, axis=-1, total_repeat_length=s.shape[-1] * block_size)
    return jnp.swapaxes(s[..., :L], -1, -2)[..., None]              # [B..., L, heads, 1]


def quantize(x, dtype=jnp.float8_e4m3fn, *, granularity: str = "block", block_size: int = 128,
             scale=None):
    """``(x8, scale)``: `x` ``[B..., L, heads, D]`` in FP8 `dtype` with float32 dequantization
    scales of the `granularity` layout (module doc). With ``scale=`` given (that layout, e.g.
    a delayed-scaling recipe's), the values are encoded with it (saturating) instead of amax."""
    d = _fp8_dtype(dtype)
    x = jnp.asarray(x)
    want = scale_shape(x.shape, granularity, block_size)
    x32 = x.astype(jnp.float32)
    if scale is None:
        xb, axes = _blocked(x32, granularity, block_size)
        amax = jnp.max(jnp.abs(xb), axis=axes, initial=0.0)   # an empty block is a zero one
        amax = jnp.where(amax > 0, jnp.maximum(amax, jnp.float32(AMAX_FLOOR)), amax)
        # XLA's max may drop NaNs: a NaN must reach the scale (the block dequantizes to NaN).
        amax = jnp.where(jnp.any(jnp.isnan(xb), axis=axes), jnp.nan, amax)
        fmax = jnp.float32(FP8_MAX[d])
        zero = amax == 0
        # amax times the float32 reciprocal of FMAX: what XLA makes of ``amax / fmax`` anyway
        # (its simplifier turns a division by a constant into that product), written out so
        # that a kernel computing the rules (`jaxflash.fp8.prologue`) multiplies too.
        scale = jnp.where(zero, jnp.float32(1.0), amax * inverse_fmax(d))
        inv = jnp.where(zero, jnp.float32(1.0), fmax / jnp.where(zero, 1.0, amax))
    else:
        scale = jnp.asarray(scale, jnp.float32)
        if scale.shape != want:
            raise ValueError(f"scale shape {scale.shape} does not match the {granularity!r} "
                             f"layout {want} of an operand of shape {x.shape}")
        inv = jnp.where(scale == 0, jnp.float32(0.0), 1.0 / jnp.where(scale == 0, 1.0, scale))
    x8 = saturating_cast(x32 * expand_scale(inv, x.shape, granularity, block_size), d)
    return x8, scale.reshape(want)


def dequantize(x8, scale, *, granularity: Optional[str] = None, block_size: int = 128,
               dtype=jnp.float32) -> jax.Array:
    """``x8.astype(float32) * scale`` (scale broadcast over its blocks), in `dtype`. The
    granularity is read from the scale's shape when not given."""
    x8 = jnp.asarray(x8)
    scale = jnp.asarray(scale, jnp.float32)
    if granularity is None:
        granularity = infer_granularity(x8.shape, scale.shape, block_size)
    want = scale_shape(x8.shape, granularity, block_size)
    if scale.shape != want:
        raise ValueError(f"scale shape {scale.shape} does not match the {granularity!r} layout "
                         f"{want} of an operand of shape {x8.shape}")
    out = x8.astype(jnp.float32) * expand_scale(scale, x8.shape, granularity, block_size)
    return out.astype(dtype)


def infer_granularity(shape, scale_shape_, block_size: int = 128) -> str:
    """Which layout a scale of `scale_shape_` is for an operand of `shape`; ValueError naming
    both shapes and the three layouts it could have had."""
    scale_shape_ = tuple(scale_shape_)
    for g in GRANULARITIES:
        if scale_shape_ == scale_shape(shape, g, block_size):
            return g
    opts = ", ".join(f"{g} {scale_shape(shape, g, block_size)}" for g in GRANULARITIES)
    raise ValueError(f"scale shape {scale_shape_} fits no layout for an operand of shape "
                     f"{tuple(shape)} (block_size {block_size}): expected {opts}")


# ---------------------------------------------------------------------------------------------
# The random-sign Hadamard transform.


def hadamard_signs(seed: Union[int, jax.Array], dim: int) -> jax.Array:
    """The +-1 float32 vector of length `dim`: from a Python int seed, drawn on the host
    (NumPy PCG64, the same on every platform and baked into the program as a constant); from
    a `jax.random` key, drawn in the program (traceable)."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        bits = np.random.default_rng(int(seed)).integers(0, 2, size=dim)
        return jnp.asarray(1.0 - 2.0 * bits, jnp.float32)
    key = seed
    if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    return jax.random.rademacher(key, (dim,), jnp.float32)


def fwht(x) -> jax.Array:
    """Unnormalized fast Walsh-Hadamard transform over the last axis (length a power of two):
    ``x @ H`` with H the Sylvester matrix, in log2(D) butterfly stages, no D x D matrix."""
    D = x.shape[-1]
    if D & (D - 1) or D < 1:
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length; got {D}")
    lead = x.shape[:-1]
    h = 1
    while h < D:
        y = x.reshape(lead + (D // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (D,))
        h *= 2
    return x


def _check_dim(D: int):
    if D not in HADAMARD_DIMS:
        raise ValueError(f"the Hadamard transform takes head dims {HADAMARD_DIMS}; got {D}")


def hadamard(x, seed: Union[int, jax.Array] = 0) -> jax.Array:
    """``(x * signs) @ H / sqrt(D)`` over the last axis, computed in float32 and returned in
    x's dtype (float32 for FP8 input). Orthogonal: ``hadamard(q) @ hadamard(k).T == q @ k.T``
    for the same `seed`. Linear (a float16 entry past 65504 rounds to inf, as any float16
    product does; precision="fp8" saturates its own transform instead, `hadamard_signed`)."""
    x = jnp.asarray(x)
    D = x.shape[-1]
    _check_dim(D)
    return hadamard_signed(x, hadamard_signs(seed, D), saturate=False)


def signed_hadamard_matrix(signs) -> jax.Array:
    """``diag(signs) H`` float32 ``[D, D]`` (entries +-1, H the Sylvester matrix, unnormalized):
    ``(x * signs) @ H == x @ signed_hadamard_matrix(signs)``, the transform as one GEMM (its
    sums in the GEMM's order, not `fwht`'s)."""
    signs = jnp.asarray(signs, jnp.float32)
    return fwht(jnp.eye(signs.shape[-1], dtype=jnp.float32)) * signs[:, None]


def hadamard_signed(x, signs, *, saturate: bool = True) -> jax.Array:
    """`hadamard` with its sign vector given (``hadamard_signs``): the arithmetic every
    implementation of the transform reproduces bit for bit: ``x * signs`` in float32, the
    butterflies of `fwht` in float32 in their order, times float32 ``1 / sqrt(D)``, rounded
    once to x's dtype (float32 for FP8 input). The transform can grow an entry by up to
    sqrt(D): finite sums beyond a 16-bit dtype's range are saturated to its largest value
    (`saturate_finite`) rather than rounded to inf (float16 entries above 65504 / sqrt(D)
    would otherwise turn whole FP8 blocks to NaN); ``saturate=False`` is the linear map (for
    its transpose)."""
    x = jnp.asarray(x)
    D = x.shape[-1]
    _check_dim(D)
    out_dt = jnp.float32 if is_fp8(x.dtype) else x.dtype
    y = fwht(x.astype(jnp.float32) * signs) * jnp.float32(1.0 / math.sqrt(D))
    if out_dt != jnp.float32 and saturate:
        y = saturate_finite(y, out_dt)
    if out_dt != jnp.float32:
        # The rounding as an op XLA keeps: with excess precision allowed (its GPU default) it
        # folds the convert pair of `astype(out_dt)` and a consumer's `astype(float32)`, and
        # the quantizer then rounds the float32 sums to FP8 directly (on the H200 1.4% of the
        # codes differed from the rules that way). bfloat16: reduce_precision (same exponent
        # range as float32, so the same rounding, and it still fuses); float16: a barrier
        # (reduce_precision flushes float16's subnormals, the convert keeps them).
        if jnp.dtype(out_dt) == jnp.dtype(jnp.bfloat16):
            y = lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7)
        else:
            return lax.optimization_barrier(y.astype(out_dt))
    return y.astype(out_dt)


def saturate_finite(y, dtype):
    """float32 `y` with finite entries beyond `dtype`'s range set to its largest value (of
    their sign), so rounding to `dtype` keeps them finite; infinities and NaN stay. Plain
    comparisons and selects, so Pallas kernels apply it as XLA does."""
    m = float(jnp.finfo(dtype).max)
    y = jnp.where((y > m) & (y != jnp.inf), jnp.float32(m), y)
    return jnp.where((y < -m) & (y != -jnp.inf), jnp.float32(-m), y)


def inverse_hadamard(y, seed: Union[int, jax.Array] = 0) -> jax.Array:
    """The inverse of `hadamard` (its transpose): ``(y @ H / sqrt(D)) * signs``."""
    y = jnp.asarray(y)
    D = y.shape[-1]
    _check_dim(D)
    x = fwht(y.astype(jnp.float32)) * jnp.float32(1.0 / math.sqrt(D)) * hadamard_signs(seed, D)
    return x.astype(y.dtype)
