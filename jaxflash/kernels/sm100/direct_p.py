"""Device pieces of FP4 Direct-P (sm_100a) that the CuTe DSL does not wrap, as inline PTX.

* `e2m1x8_relu`: eight float32 -> eight E2M1 codes in one 32-bit word, by four
  ``cvt.rn.satfinite.relu.e2m1x2.f32`` (F2FP.SATFINITE.RELU.E2M1): Direct-P's max(0, .) is the
  convert's ``.relu``, so a score pair costs one packed FMA and one convert. The DSL's own
  ``TensorSSA.to(Float4E2M1FN)`` emits the convert without ``.relu`` (and leaves the operand
  order to the lowering), hence the asm: element 0 goes to the low nibble of byte 0 (PTX puts
  the first source in the upper half), which is `jaxflash.fp4.formats`' packing order.
* `code_sum2`: 2 * (sum of the eight E2M1 values) of four such words = 2 c_B for an N32 block:
  byte permutes (PRMT) look each code up in the table 2 * {0, 1/2, 1, 3/2, 2, 3, 4, 6}, four
  carry-free 32-bit adds (each byte stays <= 8 * 12 = 96), one DP4A folds the four bytes.
  The denominator thus comes from the very codes the PV MMA consumes, with no per-element
  float decode.
* `floor_s32`: ``cvt.rmi.s32.f32`` (the block exponent e_B = floor(y_max + log2 6 - 2)).
* `bulk_g2s`: one ``cp.async.bulk`` of a contiguous chunk (a tile's scale factors) from global
  to shared memory completing on a TMA pipeline's mbarrier (the DSL wraps only the tensor
  form).
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from jaxflash.fp4 import constants as C

# byte table of 2 * E2M1 value by code 0..7 (PRMT's first source = bytes 0-3, second 4-7):
# 0x03020100 (codes 0..3: 0, .5, 1, 1.5) and 0x0C080604 (codes 4..7: 2, 3, 4, 6)
_TWICE = [int(2 * v) for v in C.E2M1_VALUES]
_TWICE_E2M1_LO = sum(b << (8 * i) for i, b in enumerate(_TWICE[:4]))
_TWICE_E2M1_HI = sum(b << (8 * i) for i, b in enumerate(_TWICE[4:]))
assert (_TWICE_E2M1_LO, _TWICE_E2M1_HI) == (0x03020100, 0x0C080604)


@dsl_user_op
def e2m1x8_relu(v, *, loc=None, ip=None) -> Int32:
    """E2M1(max(0, v[i])) for i < 8, RN-even, saturating at 6, packed low nibble first."""
    ops = [Float32(x).ir_value(loc=loc, ip=ip) for x in v]
    out = llvm.inline_asm(
        Int32.mlir_type, ops,
        "{\n.reg .b8 b0, b1, b2, b3;\n"
        "cvt.rn.satfinite.relu.e2m1x2.f32 b0, $2, $1;\n"
        "cvt.rn.satfinite.relu.e2m1x2.f32 b1, $4, $3;\n"
        "cvt.rn.satfinite.relu.e2m1x2.f32 b2, $6, $5;\n"
        "cvt.rn.satfinite.relu.e2m1x2.f32 b3, $8, $7;\n"
        "mov.b32 $0, {b0, b1, b2, b3};\n}",
        "=r,f,f,f,f,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(out)


@dsl_user_op
def code_sum2(w0, w1, w2, w3, *, loc=None, ip=None) -> Int32:
    """2 * sum of the 32 E2M1 values (non-negative codes 0..7) held in four words."""
    ops = [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1, w2, w3)]
    out = llvm.inline_asm(
        Int32.mlir_type, ops,
        "{\n.reg .b32 lo, hi, t, s, h;\n"
        f"mov.b32 lo, {_TWICE_E2M1_LO:#010x};\nmov.b32 hi, {_TWICE_E2M1_HI:#010x};\n"
        "prmt.b32 s, lo, hi, $1;\nshr.b32 h, $1, 16;\nprmt.b32 t, lo, hi, h;\nadd.u32 s, s, t;\n"
        "prmt.b32 t, lo, hi, $2;\nadd.u32 s, s, t;\nshr.b32 h, $2, 16;\nprmt.b32 t, lo, hi, h;\n"
        "add.u32 s, s, t;\n"
        "prmt.b32 t, lo, hi, $3;\nadd.u32 s, s, t;\nshr.b32 h, $3, 16;\nprmt.b32 t, lo, hi, h;\n"
        "add.u32 s, s, t;\n"
        "prmt.b32 t, lo, hi, $4;\nadd.u32 s, s, t;\nshr.b32 h, $4, 16;\nprmt.b32 t, lo, hi, h;\n"
        "add.u32 s, s, t;\n"
        "dp4a.u32.u32 $0, s, 0x01010101, 0;\n}",
        "=r,r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(out)


@dsl_user_op
def floor_s32(x, *, loc=None, ip=None) -> Int32:
    """floor(x) as int32 (saturating: -inf -> INT_MIN)."""
    out = llvm.inline_asm(Int32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)],
                          "cvt.rmi.s32.f32 $0, $1;", "=r,f", has_side_effects=False,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
                          ip=ip)
    return Int32(out)


@dsl_user_op
def as_f32(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(x).ir_value(loc=loc, ip=ip), loc=loc,
                                ip=ip))


@dsl_user_op
def bulk_g2s(smem: cute.Pointer, gmem: cute.Pointer, size: int, mbar: cute.Pointer, *,
             loc=None, ip=None):
    """smem[0:size) = gmem[0:size) (bytes; 16-byte aligned, size a multiple of 16), completing
    ``size`` transaction bytes on ``mbar``. One thread issues."""
    llvm.inline_asm(
        None, [smem.toint(loc=loc, ip=ip).ir_value(), gmem.llvm_ptr,
               Int32(size).ir_value(), mbar.toint(loc=loc, ip=ip).ir_value()],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
