"""exp2 of a score pair on the FMA pipes (sm_100a): the polynomial of `variants.exp2_poly`.

Blackwell's MUFU.EX2 issues 16 per clock and SM while the packed FP32 pipes (FFMA2 / FADD2)
do 64 pairs; FlashAttention-4 moves a share of each row's exponentials onto them. The sequence
and its error are documented, and modelled bit for bit, in `jaxflash.kernels.variants.exp2_poly`.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from jaxflash.kernels.variants.exp2_poly import C1, C2, C3, CLAMP_LOW, ROUND_MAGIC


@dsl_user_op
def _as_i32(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc,
                              ip=ip))


@dsl_user_op
def _as_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(x).ir_value(loc=loc, ip=ip), loc=loc,
                                ip=ip))


@cute.jit
def exp2_poly_pair(x0: Float32, x1: Float32):
    """(2**x0, 2**x1) for x <= 127: clamp, split at floor by a round-down add, cubic on the
    fraction, floor added to the exponent field (steps 1-6 of `exp2_poly`)."""
    lo = Float32(CLAMP_LOW)
    x0 = cute.arch.fmax(x0, lo)
    x1 = cute.arch.fmax(x1, lo)
    magic = Float32(ROUND_MAGIC)
    t0, t1 = cute.arch.add_packed_f32x2((x0, x1), (magic, magic), rnd="rm")
    j0, j1 = cute.arch.sub_packed_f32x2((t0, t1), (magic, magic))
    f0, f1 = cute.arch.sub_packed_f32x2((x0, x1), (j0, j1))
    c3, c2, c1, one = Float32(C3), Float32(C2), Float32(C1), Float32(1.0)
    p0, p1 = cute.arch.fma_packed_f32x2((c3, c3), (f0, f1), (c2, c2))
    p0, p1 = cute.arch.fma_packed_f32x2((p0, p1), (f0, f1), (c1, c1))
    p0, p1 = cute.arch.fma_packed_f32x2((p0, p1), (f0, f1), (one, one))
    r0 = _as_f32(_as_i32(p0) + (_as_i32(t0) << Int32(23)))
    r1 = _as_f32(_as_i32(p1) + (_as_i32(t1) << Int32(23)))
    return r0, r1
