"""The prologue of ``precision="fp8"``: float q, k, v -> FP8 codes and canonical scales
``[B, heads, nb]``, with the random-sign Hadamard transform of Q and K first.

Every implementation here produces the codes and scales of `jaxflash.quantize`'s rules bit for
bit (``hadamard_signed`` then ``quantize``; tests/fp8/test_prologue.py checks each); they
differ only in how many passes over memory they take:

- ``"reference"``: `jaxflash.quantize` as written (the Hadamard materialized, the operand
  transposed to ``[B, heads, L, D]`` for the amax, the scales expanded through a cumsum-based
  repeat): several full passes.
- ``"xla"``: the same arithmetic arranged for XLA's fusion: the amax reduces the blocks where
  they lie (``[B, nb, block, heads, D]``, no transpose or pad of the operand), the codes
  multiply by a broadcast of the per-block inverse, only the small scale array is transposed.
- ``"triton"``: one Pallas (Triton) kernel per operand, one read and one write
  (`jaxflash.fp8.prologue_triton`); CUDA only, single-device (an opaque kernel would make the
  SPMD partitioner gather a sharded operand, the XLA arrangement partitions like any jnp code).
- ``"triton_gemm"``: the same kernel with the Hadamard of a 16-bit operand as a tensor-core
  product instead of butterflies. Not bit for bit: its float32 sums round in the MMA's order,
  so a code (or a block's scale) differs by one step where a sum lies within a float32 ulp of
  a rounding boundary, and an all-zero row's transform is +0 where the butterflies give -0.
  Operands it cannot take (float32, no Hadamard) run ``"triton"``.

`IMPL` picks the one CUDA calls use; anything a pick cannot take (another platform, a sharded
trace, a shape the kernel does not tile) runs the ``"xla"`` arrangement, with the same result.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxflash import quantize as Q
from jaxflash._types import triton_helpers_run
from jaxflash.fp8 import layout

IMPLS = ("reference", "xla", "triton", "triton_gemm")
# The CUDA pick, one constant (benchmarks/fp8_prologue_bench.py measures every candidate).
# ``"triton_gemm"``: 1.9-2.3 TB/s on the H200 against the butterflies' 0.6-0.9 (the shuffles of
# their in-tile stages bound that kernel), with 0 codes differing from the rules on the bench's
# operands (tests/fp8/test_prologue_gpu.py bounds the difference by a code step); "triton" and
# "xla" stay bit for bit; "xla" serves what no kernel can take.
IMPL = "triton_gemm"
# The butterfly kernel's tuning by head dim (`prologue_triton.quantize_blocks`: num_warps,
# columns per tile, rows per pass; the result does not depend on it), the fastest measured on
# the H200 at S = 4k: hd 64 one 64-column tile, the block in one pass (888 GB/s); hd 128
# 16-column tiles, 64 rows a pass (801 GB/s). At hd 256, 16 columns and 8 warps: with 8
# columns (32 tiles, each butterfly stage past the tile unrolled over all of them) the Triton
# program is four times hd 128's and takes minutes to compile; this one is hd 128's size.
TRITON_CONFIG = {16: (2, 8, 128), 32: (2, 8, 128), 64: (4, 64, 128), 128: (4, 16, 64),
                 256: (8, 16, 64)}
# ``"triton_gemm"``'s tuning: (num_warps, output columns per product, rows per pass), the
# fastest of the H200 sweeps at S = 4k (the top few lie within 5%): hd 64 2.34 TB/s, hd 128
# 1.71-1.87, hd 256 1.28-1.33 (narrower products keep the float32 tile in registers; at hd 256
# the whole-width product spills).
GEMM_CONFIG = {16: (2, 16, 128), 32: (2, 32, 128), 64: (4, 64, 128), 128: (8, 64, 128),
               256: (8, 128, 128)}
# Operands without the Hadamard (V, or ``hadamard=False``): amax and codes only, the same
# (num_warps, columns per tile, rows per pass); the sweep's fastest at hd 64 / 128 / 256 (V's
# own tiling moved Q, K and V together from 1.67 to 1.89 TB/s at hd 128, 1.26 to 1.39 at 256).
PLAIN_CONFIG = {**TRITON_CONFIG, 64: (8, 64, 128), 128: (4, 128, 128), 256: (4, 256, 64)}


def _reference(x, dtype, block, signs):
    if signs is not None:
        x = Q.hadamard_signed(x, signs)
    return layout.quantize_canonical(x, dtype, "block", block)


def _xla(x, dtype, block, signs, amax_floor: float = 0.0, divide: bool = False):
    """The rules arranged for XLA's fusion; `amax_floor` / `divide` as the kernel's
    (`prologue_triton.quantize_blocks`: the FP8 backward's dO rule)."""
    d = jnp.dtype(dtype)
    if signs is not None:
        x = Q.hadamard_signed(x, signs)
    B, L, H, D = x.shape
    nb = -(-L // block)
    x32 = x.astype(jnp.float32)
    if nb * block != L:
        x32 = jnp.pad(x32, ((0, 0), (0, nb * block - L), (0, 0), (0, 0)))
    xb = x32.reshape(B, nb, block, H, D)
    amax = jnp.max(jnp.abs(xb), axis=(2, 4))                       # [B, nb, H]
    if amax_floor:
        amax = jnp.where(amax > 0, jnp.maximum(amax, jnp.float32(amax_floor)), amax)
    amax = jnp.where(jnp.any(jnp.isnan(xb), axis=(2, 4)), jnp.nan, amax)
    fmax = jnp.float32(Q.FP8_MAX[d])
    zero = amax == 0
    scale = jnp.where(zero, jnp.float32(1.0), amax / fmax if divide
                      else amax * Q.inverse_fmax(d))
    inv = jnp.where(zero, jnp.float32(1.0), fmax / jnp.where(zero, 1.0, amax))
    x8 = Q.saturating_cast(xb * inv[:, :, None, :, None], d)
    x8 = x8.reshape(B, nb * block, H, D)[:, :L]
    return x8, jnp.swapaxes(scale, 1, 2)                            # [B, H, nb]


def _triton(x, dtype, block, signs, interpret=False, gemm=False, amax_floor=0.0,
            divide=False):
    from jaxflash.fp8 import prologue_triton as T
    gemm = gemm and signs is not None and T.gemm_supported(x.dtype)
    config = GEMM_CONFIG if gemm else TRITON_CONFIG if signs is not None else PLAIN_CONFIG
    warps, width, rows = config[x.shape[-1]]
    return T.quantize_blocks(x, signs, dtype=jnp.dtype(dtype), block=block, num_warps=warps,
                             width=min(width, x.shape[-1]), rows=min(rows, block), gemm=gemm,
                             amax_floor=amax_floor, divide=divide, interpret=interpret)


def _triton_gemm(x, dtype, block, signs, interpret=False, amax_floor=0.0):
    return _triton(x, dtype, block, signs, interpret, gemm=True, amax_floor=amax_floor)


def pick(x, block: int, platform: str, impl=None) -> str:
    """The implementation a call runs: `impl` (default `IMPL`) where it can, else ``"xla"``."""
    impl = impl or IMPL
    if impl not in IMPLS:
        raise ValueError(f"prologue implementation must be one of {IMPLS}; got {impl!r}")
    if impl in ("triton", "triton_gemm"):
        from jaxflash.fp8 import prologue_triton as T
        if not (T.supports(x.shape, block) and triton_helpers_run(platform, x)):
            return "xla"
    return impl


def describe(problem, spec, in_dtype) -> str:
    """`explain`'s sentence on the prologue a precision="fp8" call of `problem` (on float
    operands of `in_dtype`) takes, per operand when they differ. Outside a trace it cannot
    see a sharded operand: inside a jit trace of a multi-device process the XLA arrangement
    runs instead of the kernel."""
    P = problem
    shapes = {"q": ((P.batch, P.q_len, P.num_heads, P.head_dim), spec.q_block),
              "k": ((P.batch, P.kv_len, P.num_kv_heads, P.head_dim), spec.k_block),
              "v": ((P.batch, P.kv_len, P.num_kv_heads, P.head_dim_v), spec.v_block)}
    # per-tensor / per-head scales (`scale_granularity`) take quantize's own XLA layouts
    from jaxflash.fp8 import prologue_triton as T
    picks = {n: (pick(jax.ShapeDtypeStruct(shape, jnp.float32), block, P.platform)
                 if g == "block" else "xla")
             for (n, (shape, block)), g in zip(shapes.items(), spec.granularity)}
    for n in picks:   # the tensor-core Hadamard: 16-bit Q and K (V has no Hadamard)
        if picks[n] == "triton_gemm" and (n == "v" or not spec.hadamard
                                          or not T.gemm_supported(in_dtype)):
            picks[n] = "triton"
    kernel = ("one Pallas (Triton) pass per operand (the XLA arrangement inside a jit trace "
              "of a multi-device process)")
    what = {"triton": kernel,
            "triton_gemm": kernel + ", the Hadamard of 16-bit operands as a tensor-core product",
            "xla": "the rules arranged for XLA's fusion",
            "reference": "jaxflash.quantize's rules as written"}
    if len(set(picks.values())) == 1:
        which = picks["q"]
        return f"FP8 prologue (Hadamard, amax, codes, scales): {which}, {what[which]}"
    kernels = [w for w in picks.values() if w.startswith("triton")]
    return "FP8 prologue (Hadamard, amax, codes, scales): " + ", ".join(
        f"{n} {w}" for n, w in picks.items()) + (f" ({what[max(kernels, key=len)]})"
                                                 if kernels else "")


def zero_past_length(x, lengths, positions=None):
    """``x [B, L, heads, D]`` with the rows at or past each batch element's length (``lengths
    [B]``, None: all kept) set to 0; `positions` ``[L]`` are the rows' global positions
    (default ``arange(L)``). precision="fp8" quantizes the masked padding this way first:
    its values never enter the result, so they must not set a block's amax either (a NaN or
    a huge value there would poison the valid rows sharing its scale)."""
    if lengths is None:
        return x
    pos = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None else positions
    keep = pos[None, :] < lengths.astype(jnp.int32)[:, None]
    return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))


def quantize_operand(x, dtype, granularity: str, block: int, signs=None, *,
                     platform: str = "cpu", impl=None):
    """A canonical operand ``x [B, L, heads, D]`` (float) -> ``(x8, scale [B, heads, nb])``:
    `jaxflash.quantize`'s rules for `granularity` with `block` the canonical block
    (`layout.canonical_block`), after ``hadamard_signed(x, signs)`` when `signs` is given."""
    if granularity != "block":
        if signs is not None:
            x = Q.hadamard_signed(x, signs)
        return layout.quantize_canonical(x, dtype, granularity, block)
    which = pick(x, block, platform, impl)
    return {"reference": _reference, "xla": _xla, "triton": _triton,
            "triton_gemm": _triton_gemm}[which](x, dtype, block, signs,
                                                **({} if which == "reference" else
                                                   {"amax_floor": Q.AMAX_FLOOR}))


# The FP8 backward's dO quantization (`quantize_rows`): the Triton kernel, bit for bit XLA's
# codes and scales on the H200 (tests/fp8/test_prologue_gpu.py::test_quantize_rows_on_gpu).
# XLA's form of the rule (a block amax reduce, then the convert) ran as one fusion of 240-250 us
# at B*S = 16k, hd 128 (one read of bf16 dO, ~0.5 TB/s); the kernel takes ~35 us.
ROWS_IMPL = "triton"


def quantize_rows(x, dtype, rows: int, amax_floor: float, platform: str):
    """The FP8 backward's dO rule on ``x [B, T, N, H]``: codes and one scale per (batch, head,
    `rows` rows) ``[B, N, ceil(T / rows)]``, a nonzero amax raised to `amax_floor`, the scale
    ``amax / FMAX``; with ``ROWS_IMPL == "triton"`` the Triton kernel (one pass,
    `PLAIN_CONFIG`'s tiling) where it can run, else XLA (the same rule, bit for bit)."""
    impl = _triton if pick(x, rows, platform, ROWS_IMPL) == "triton" else _xla
    return impl(x, dtype, rows, None, amax_floor=amax_floor, divide=True)


def hadamard_transpose(g, signs, platform: str):
    """The transpose of ``quantize.hadamard_signed(., signs)`` applied to `g` (what autodiff
    gives: precision="fp8"'s gradient for Q and K through the prologue's transform). On a CUDA
    device with the tensor-core prologue (``IMPL == "triton_gemm"``) and a 16-bit `g`: one
    GEMM ``g @ (diag(signs) H)^T / sqrt(D)`` accumulated in float32, rounded once to g's dtype
    (the butterflies of the float32 transpose take several passes in XLA); elsewhere (and on
    a GPU the prologue kernel does not run on) the transpose of the butterflies."""
    from jaxflash.fp8 import prologue_triton as T
    D = g.shape[-1]
    if IMPL == "triton_gemm" and T.gemm_supported(g.dtype) and triton_helpers_run(platform):
        hs = Q.signed_hadamard_matrix(signs).astype(g.dtype)
        y = jnp.einsum("...e,de->...d", g, hs, preferred_element_type=jnp.float32)
        return (y * jnp.float32(1.0 / math.sqrt(D))).astype(g.dtype)
    had = lambda x: Q.hadamard_signed(x, signs, saturate=False)
    # (g itself as the primal's type: inside shard_map it carries g's varying mesh axes)
    return jax.linear_transpose(had, g)(g)[0]
