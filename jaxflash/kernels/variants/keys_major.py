"""FP8 operands turned keys-major for the Hopper FP8 kernels' K-major wgmma operands: ``x8
[B, L, heads, H]`` -> ``[B, heads, H, length]`` (sequence contiguous, zero padded to `length`),
the sequence permuted within each 16 rows as a ``split`` says (``(dims, perm)``: row
``16c + r``, r written in the mixed radix `dims`, goes to position ``16c + r'`` with r's digits
reordered by `perm`). The forward's V^T (`fwd_fp8_launch.V_SPLIT`) and the backward's Q^T, K^T,
dO^T (`bwd_fp8_launch.Q_SPLIT` / `K_SPLIT`) are all this one move.

Two implementations of the same bytes: ``"xla"`` (one XLA transpose of the bytes) and
``"triton"`` (one Pallas (Triton) program per 128 rows of one (batch row, head): the tile read
once, permuted and transposed in registers, written once); `IMPL` picks, and what the kernel
cannot take (another platform or arch, a sharded trace, a length it does not tile) runs XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxflash import _vma

_SQ = getattr(pl, "squeezed", None)

# The Triton kernel: the same bytes as XLA's transpose on the H200 (tests/kernels/
# test_keys_major_gpu.py), 16-20 us a copy at B*S = 16k, hd 128, against XLA's 22-42 us.
IMPL = "triton"
ROWS = 128          # rows per Triton program (a multiple of 16)


def keys_major(x8, split, length: int, platform: str = "cuda", impl=None):
    """``x8 [B, L, heads, H]`` (FP8 or uint8) -> ``[B, heads, H, length]``, `split`'s order."""
    if pick(x8, length, platform, impl) == "triton":
        return _triton(x8, split)
    return _xla(x8, split, length)


def pick(x8, length: int, platform: str, impl=None) -> str:
    from jaxflash._types import triton_helpers_run
    impl = impl or IMPL
    if impl not in ("xla", "triton"):
        raise ValueError(f"keys-major implementation must be 'xla' or 'triton'; got {impl!r}")
    if impl == "triton" and not (supports(x8.shape, length, x8.dtype)
                                 and triton_helpers_run(platform, x8)):
        return "xla"
    return impl


def supports(shape, length: int, dtype=jnp.uint8) -> bool:
    """One-byte elements, whole 128-row programs, no padding, a power-of-two head dim; CUDA's
    grid y / z and int32 offsets bound the rest."""
    B, L, Hd, H = shape
    if jnp.dtype(dtype).itemsize != 1:
        return False
    return (L == length and L % ROWS == 0 and H >= 16 and H & (H - 1) == 0 and H <= 256
            and L // ROWS <= 65535 and Hd <= 65535 and B * L * Hd * H < 2 ** 31)


def _xla(x8, split, length: int):
    dims, perm = split
    B, L, Hd, H = x8.shape
    # FP8 as bytes (XLA transposes any 8-bit type); other dtypes move as they are
    as_bytes = x8.dtype.itemsize == 1 and x8.dtype != jnp.uint8
    u = jax.lax.bitcast_convert_type(x8, jnp.uint8) if as_bytes else x8
    u = jnp.pad(u, ((0, 0), (0, length - L), (0, 0), (0, 0)))
    u = u.reshape((B, length // 16) + tuple(dims) + (Hd, H))
    d = len(dims)
    u = jnp.transpose(u, (0, d + 2, d + 3, 1) + tuple(2 + a for a in perm))
    u = u.reshape(B, Hd, H, length)
    return jax.lax.bitcast_convert_type(u, x8.dtype) if as_bytes else u


def _kernel(x_ref, o_ref, *, dims, perm):
    R, H = x_ref.shape
    t = x_ref[...]
    t = t.reshape((R // 16,) + tuple(dims) + (H,))
    t = jnp.transpose(t, (0,) + tuple(1 + a for a in perm) + (len(dims) + 1,))
    o_ref[...] = jnp.transpose(t.reshape(R, H), (1, 0))


def _triton(x8, split, interpret: bool = False):
    return _triton_bytes(x8, tuple(split[0]), tuple(split[1]), interpret)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _triton_bytes(x8, dims, perm, interpret):
    B, L, Hd, H = x8.shape
    u = jax.lax.bitcast_convert_type(x8, jnp.uint8) if x8.dtype != jnp.uint8 else x8
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
    out = _vma.kernel_call(pl.pallas_call(
        functools.partial(_kernel, dims=dims, perm=perm),
        grid=(B, L // ROWS, Hd),
        in_specs=[pl.BlockSpec((_SQ, ROWS, _SQ, H), lambda b, i, h: (b, i, h, 0))],
        out_specs=pl.BlockSpec((_SQ, _SQ, H, ROWS), lambda b, i, h: (b, h, 0, i)),
        out_shape=jax.ShapeDtypeStruct((B, Hd, H, L), jnp.uint8),
        interpret=interpret,
        name="fp8_keys_major",
        **params,
    ), u)
    return out if x8.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(out, x8.dtype)
