"""The FP8 prologue as one Pallas (Triton) kernel: each program reads one scale block of one
operand (``block`` sequence rows of one (batch row, head), the whole head dim) once, applies
the random-sign Hadamard transform (butterflies in registers, or with ``gemm`` one
tensor-core product), takes the block's amax, and writes the E4M3 / E5M2 codes and the block's
float32 dequantization scale, straight into the canonical ``[B, heads, nb]`` layout.

With the butterflies (and without a Hadamard), bit for bit the rules of `jaxflash.quantize`
(``hadamard_signed`` then ``quantize``; ``gemm`` differs only in its sums' order): the same
float32 butterflies in the same order (tile reshapes and transposes move values, never combine
them differently), the Hadamard output rounded once to the input's dtype, the amax over the
block with NaN detected separately (Triton's max drops NaNs, XLA's rule poisons the block), the
scale as the product by the float32 ``1 / FMAX`` (XLA's form of the rule), the codes' FMAX / amax
by the platform's float32 division as XLA does it there (on the H200 XLA's is not correctly
rounded: 27% of 448 / amax over bf16 amax values differ from IEEE by an ulp, and a correctly
rounded ``div.rn.f32`` here made 0.07% of the codes differ; Triton's own ``/`` matches XLA's),
saturation before the round-to-nearest-even cast. Under ``interpret=True`` (any device) the
same body runs as JAX ops, with XLA's division on that device.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxflash import _vma
from jaxflash import quantize as Q

_SQ = getattr(pl, "squeezed", None)   # a squeezed block dim (None in older Pallas)


def supports(shape, block: int) -> bool:
    """Whether the kernel takes an operand of `shape` ``[B, L, heads, D]`` with `block`-row
    scale blocks: Triton tiles have power-of-two sides, the rows must tile L exactly, and the
    launch grid and int32 indexing have limits."""
    if not all(isinstance(d, numbers.Integral) for d in shape):
        return False  # a symbolic dim (jax.export): the XLA form serves any shape
    B, L, H, D = shape
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0
    # The grid (B, blocks, heads) maps to CUDA's (x, y, z): y and z stop at 65535. Pallas'
    # Triton offsets are int32.
    return (pow2(block) and 16 <= block <= 256 and pow2(D) and 16 <= D <= 256
            and L % block == 0 and L // block <= 65535 and H <= 65535
            and B * L * H * D < 2 ** 31)


def _fwht_tile(x):
    """`jaxflash.quantize.fwht` on a ``[R, D]`` float32 tile with the moves Triton lowers
    (reshape, transpose, a size-2 split and join on the last axis): stage h adds and subtracts
    the halves of each 2h-wide group, as the reference does."""
    R, D = x.shape
    h = 1
    while h < D:
        g = D // (2 * h)
        y = jnp.swapaxes(x.reshape(R, g, 2, h), 2, 3)          # [R, g, h, 2]: pairs last
        a, b = jnp.split(y, 2, axis=-1)                         # [R, g, h, 1] each
        y = jnp.concatenate([a + b, a - b], axis=-1)            # [R, g, h, 2]
        x = jnp.swapaxes(y, 2, 3).reshape(R, D)
        h *= 2
    return x


def _transformed(x_ref, s_ref, r0: int, rows: int, width: int, in_dtype, gemm: bool):
    """Rows ``[r0, r0 + rows)`` of the block as a list of ``[rows, width]`` float32 column
    tiles, Hadamard-transformed when `s_ref` is given. Butterflies: stage h < width runs
    inside each tile (`_fwht_tile`); a stage h >= width pairs whole tiles j and j + h / width,
    elementwise, with no data movement between threads; the stage order is the reference's.
    `gemm`: `s_ref` holds the signed Hadamard matrix itself (``diag(signs) H``, +-1 in the
    input's dtype) and each tile is one tensor-core product ``x @ H[:, tile]`` accumulated in
    float32: exact products, the sums in the MMA's order instead of the butterflies'."""
    D = x_ref.shape[-1]
    cols = [pl.ds(j * width, width) for j in range(D // width)]
    if gemm:
        x = x_ref[pl.ds(r0, rows), :]
        c = jnp.float32(1.0 / math.sqrt(D))
        return [Q.saturate_finite(jnp.dot(x, s_ref[:, cj], preferred_element_type=jnp.float32)
                                  * c, in_dtype).astype(in_dtype).astype(jnp.float32)
                for cj in cols]
    ts = [x_ref[pl.ds(r0, rows), c].astype(jnp.float32) for c in cols]
    if s_ref is None:
        return ts
    ts = [_fwht_tile(t * s_ref[:, c]) for t, c in zip(ts, cols)]
    hs = 1
    while hs < len(ts):
        for j in range(len(ts)):
            if not j & hs:
                ts[j], ts[j + hs] = ts[j] + ts[j + hs], ts[j] - ts[j + hs]
        hs *= 2
    c = jnp.float32(1.0 / math.sqrt(D))
    # x's dtype, saturated, as hadamard_signed()
    return [Q.saturate_finite(t * c, in_dtype).astype(in_dtype).astype(jnp.float32) for t in ts]


def _kernel(*refs, hadamard: bool, in_dtype, out_dtype, width: int, rows: int, gemm: bool,
            amax_floor: float, divide: bool):
    if hadamard:
        x_ref, s_ref, o_ref, sc_ref = refs
    else:
        (x_ref, o_ref, sc_ref), s_ref = refs, None
    block = x_ref.shape[0]
    load = lambda r0: _transformed(x_ref, s_ref, r0, rows, width, in_dtype, gemm)
    # Pass 1: the block's amax (and whether it holds a NaN: Triton's max drops NaNs). With
    # `rows` < block, pass 2 recomputes the tiles (the block's second read hits L2) instead of
    # holding the whole block in registers.
    first = load(0)
    acc = nan = None
    for r0 in range(0, block, rows):
        for t in (first if r0 == 0 else load(r0)):
            a, n = jnp.abs(t), jnp.where(t != t, 1.0, 0.0)
            acc, nan = (a, n) if acc is None else (jnp.maximum(acc, a), jnp.maximum(nan, n))
    amax = jnp.max(acc, axis=(0, 1), keepdims=True)             # [1, 1]
    if amax_floor:
        amax = jnp.where(amax > 0, jnp.maximum(amax, jnp.float32(amax_floor)), amax)
    amax = jnp.where(jnp.max(nan, axis=(0, 1), keepdims=True) > 0, jnp.float32(jnp.nan), amax)
    fmax = float(Q.FP8_MAX[jnp.dtype(out_dtype)])     # a Python constant: Triton folds it
    zero = amax == 0
    one = jnp.ones_like(amax)
    # the rules' product by 1 / FMAX (the dO rule's division with `divide`)
    scale = jnp.where(zero, one, amax / jnp.float32(fmax) if divide
                      else amax * Q.inverse_fmax(out_dtype))
    inv = jnp.where(zero, one, jnp.float32(fmax) / jnp.where(zero, one, amax))
    for r0 in range(0, block, rows):
        ts = first if rows == block else load(r0)
        for j, t in enumerate(ts):
            y = t * inv
            # Saturate (never NaN / Inf from range), but keep NaN: Triton's min / max drop it.
            y = jnp.where(y != y, y, jnp.clip(y, -fmax, fmax))
            o_ref[pl.ds(r0, rows), pl.ds(j * width, width)] = y.astype(out_dtype)
    sc_ref[...] = scale.reshape(sc_ref.shape)


def gemm_supported(dtype) -> bool:
    """The tensor-core Hadamard takes 16-bit floats (+-1 and their products exact); a float32
    operand would round to TF32 in the MMA."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(jax.jit, static_argnames=("dtype", "block", "num_warps", "width", "rows",
                                             "gemm", "amax_floor", "divide", "interpret"))
def quantize_blocks(x, signs, *, dtype, block: int, num_warps: int = 4, width=None, rows=None,
                    gemm: bool = False, amax_floor: float = 0.0, divide: bool = False,
                    interpret: bool = False):
    """``x [B, L, heads, D]`` (float) -> ``(x8 [B, L, heads, D] in dtype, scale [B, heads, nb]
    float32)``, with the Hadamard transform of `signs` (a ``[D]`` +-1 float32 vector) first
    unless `signs` is None. The caller checks `supports`. Tuning (same result): `width`, the
    columns per tile (a power of two dividing D; default D: one tile), `rows`, the rows per
    pass (a power of two dividing block; default block: one pass, the block held whole).
    `gemm` (16-bit `x` only, `gemm_supported`): the Hadamard as a tensor-core product, whose
    float32 sums may round differently from the rules' butterflies (a code or a scale then
    differs by one step where a sum lies within a float32 ulp of a rounding boundary).
    `amax_floor` and `divide`: the FP8 backward's rule for dO (`prologue.quantize_rows`): a
    nonzero block amax raised to `amax_floor` first, the scale as
    ``amax / FMAX`` instead of the product by ``1 / FMAX``."""
    B, L, H, D = x.shape
    nb = L // block
    hadamard = signs is not None
    in_specs = [pl.BlockSpec((_SQ, block, _SQ, D), lambda b, i, h: (b, i, h, 0))]
    args = [x]
    if gemm and not (hadamard and gemm_supported(x.dtype)):
        raise ValueError(f"gemm takes the Hadamard of a bfloat16 / float16 operand; got "
                         f"{x.dtype}{'' if hadamard else ' without signs'}")
    if gemm:
        in_specs.append(pl.BlockSpec((D, D), lambda b, i, h: (0, 0)))
        args.append(Q.signed_hadamard_matrix(signs).astype(x.dtype))   # +-1: exact
    elif hadamard:
        in_specs.append(pl.BlockSpec((1, D), lambda b, i, h: (0, 0)))
        args.append(jnp.asarray(signs, jnp.float32).reshape(1, D))
    width, rows = width or D, rows or block
    if D % width or block % rows or width & (width - 1) or rows & (rows - 1):
        raise ValueError(f"width {width} / rows {rows} must be powers of two dividing the head "
                         f"dim {D} / the block {block}")
    kernel = functools.partial(_kernel, hadamard=hadamard, in_dtype=x.dtype,
                               out_dtype=jnp.dtype(dtype), width=width, rows=rows, gemm=gemm,
                               amax_floor=float(amax_floor), divide=divide)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    return _vma.kernel_call(pl.pallas_call(
        kernel,
        grid=(B, nb, H),           # heads fastest: neighbouring programs read neighbouring rows
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((_SQ, block, _SQ, D), lambda b, i, h: (b, i, h, 0)),
                   pl.BlockSpec((_SQ, _SQ, 1), lambda b, i, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)),
                   jax.ShapeDtypeStruct((B, H, nb), jnp.float32)],
        interpret=interpret,
        name="fp8_prologue",
        **params,
    ), *args)
