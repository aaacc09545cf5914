"""exp2 of one float on the FMA and integer pipes: the polynomial of `variants.exp2_poly`.

MUFU.EX2 issues 16 results per clock and SM. Where a kernel's exponentials (and, in the FP8
forward, P's conversions) keep that unit busier than the tensor cores, a share of them can run
as this sequence instead (FlashAttention-4's trick; the sm_100a kernels use the packed form in
`sm100.exp2`; this scalar form is Hopper's, which has no packed FP32 ops). The steps and their error are documented, and modelled bit for bit, in
`jaxflash.kernels.variants.exp2_poly`; here they are one PTX block with explicit rounding (no
.ftz, no contraction left to the compiler), so the result is the model's.
"""
from __future__ import annotations

import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from jaxflash.kernels.variants.exp2_poly import C1, C2, C3, CLAMP_LOW, ROUND_MAGIC


def _hex(v: float) -> str:
    """A float32 constant as PTX writes it (0fXXXXXXXX: the exact bits)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


_ASM = (
    "{\n.reg .f32 xc, t, j, f, p;\n.reg .b32 tb, pb;\n"
    f"max.f32 xc, $1, {_hex(CLAMP_LOW)};\n"        # 1. clamp (a NaN input gives the clamp)
    f"add.rm.f32 t, xc, {_hex(ROUND_MAGIC)};\n"    # 2. t's low mantissa bits = floor(xc)
    f"sub.rn.f32 j, t, {_hex(ROUND_MAGIC)};\n"     # 3. floor(xc), exact
    "sub.rn.f32 f, xc, j;\n"                       # 4. the fraction
    f"fma.rn.f32 p, {_hex(C3)}, f, {_hex(C2)};\n"  # 5. the cubic
    f"fma.rn.f32 p, p, f, {_hex(C1)};\n"
    f"fma.rn.f32 p, p, f, {_hex(1.0)};\n"
    "mov.b32 tb, t;\nmov.b32 pb, p;\n"             # 6. floor(xc) into the exponent
    "shl.b32 tb, tb, 23;\nadd.s32 pb, pb, tb;\nmov.b32 $0, pb;\n}")


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x for x <= 127 without MUFU (`exp2_poly.model_exp2` bit for bit); -inf gives +0."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)], _ASM, "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
