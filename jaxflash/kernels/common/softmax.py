"""Online softmax in registers for sm_90 accumulators (exp2 form), shared by forward kernels.

Each consumer thread owns a few query rows of the 64-row wgmma tile; each row is spread over the
4 threads of a quad, so row reductions are a thread-local pass plus two butterfly shuffles.

Scores arrive as raw logits x (or tanh-capped values when softcap is on); ``scale_log2`` turns
them into log2 units: p = exp2(x * scale_log2 - m * scale_log2), one FFMA + one MUFU.EX2 each.
A row whose max is still -inf (nothing visible yet) uses 0 as its max so no NaN appears; its
probabilities are exp2(-inf) = 0.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jaxflash.kernels.common.carry import Carried
from jaxflash.kernels.common.layouts import acc_as_rows_cols

LN2 = math.log(2.0)
# `OnlineSoftmax.step_lazy`: how far (log2 units) a row's max may run ahead of its reference
# before the output is rescaled. FlashAttention-4 uses 8 (probabilities <= 256); 0 here: a row
# rescales whenever its max grows, exactly as `step`, so results are bitwise those of `step`
# and only the multiplications by exactly 1 are skipped. With 8, the error against float64
# was 1.04-1.16x cuDNN's on the H200: a stale reference leaves the dominant probability
# rounded to bf16 instead of an exact 1 (docs/design.md).
LAZY_RESCALE_LOG2 = 0.0


@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def _row_max(s: cute.Tensor, r: int, ncol: int):
    """Max of row r of a (rows, cols) fragment view, this thread's columns only. 4 independent
    partial maxima give the scheduler ILP over the FMNMX chain. Plain Python, inlined while
    tracing (so a Python loop: the DSL rewrites range_constexpr only in jit functions)."""
    m0 = s[r, 0]
    m1 = s[r, 1]
    m2 = s[r, 2]
    m3 = s[r, 3]
    for c in range(1, ncol // 4):
        m0 = cute.arch.fmax(m0, s[r, 4 * c])
        m1 = cute.arch.fmax(m1, s[r, 4 * c + 1])
        m2 = cute.arch.fmax(m2, s[r, 4 * c + 2])
        m3 = cute.arch.fmax(m3, s[r, 4 * c + 3])
    return cute.arch.fmax(cute.arch.fmax(m0, m1), cute.arch.fmax(m2, m3))


class OnlineSoftmax(Carried):
    """Running row max / row sum for the rows one thread owns."""

    _dynamic = ("scale_log2", "row_max", "row_sum")

    def __init__(self, scale_log2: Float32, num_rows: int, p_shift_log2: int = 0):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        # Probabilities come out scaled by 2**p_shift_log2 (static). The FP8 forward uses 8: P
        # then spans e4m3's range up to 256 (<= 448) instead of [0, 1], so small probabilities
        # keep normal precision; the row sum carries the same factor (it cancels in O) and the
        # LSE takes it out.
        self.p_shift_log2 = p_shift_log2
        self.row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        self.row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)

    @cute.jit
    def step(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool],
             col_scale=None) -> cute.Tensor:
        """Exponentiate the block's scores in place; return the per-row factor by which the
        output accumulator must be rescaled (1 on the first block). `col_scale` (optional, > 0):
        a factor every score of the block still lacks (the FP8 kernel's key-block scale). It
        scales the block's row max once per row and joins the exponent's multiplier, so the
        scores are never multiplied one by one: the same FFMA per element as without it."""
        s = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        ncol = cute.size(s, mode=[1])
        assert ncol % 4 == 0
        scale_e = self.scale_log2
        if cutlass.const_expr(col_scale is not None):
            scale_e = self.scale_log2 * col_scale
        for r in cutlass.range_constexpr(self.num_rows):
            m = _row_max(s, r, ncol)
            if cutlass.const_expr(col_scale is not None):
                m = m * col_scale      # max(x * c) = max(x) * c for c > 0, -inf stays -inf
            if cutlass.const_expr(not is_first):
                m = cute.arch.fmax(m, self.row_max[r])
            m = quad_allreduce_max(m)
            m_safe = m
            if m == -Float32.inf:
                m_safe = Float32(0.0)
            neg_max_scaled = -m_safe * self.scale_log2
            if cutlass.const_expr(self.p_shift_log2 != 0):
                neg_max_scaled = neg_max_scaled + Float32(self.p_shift_log2)
            for c in cutlass.range_constexpr(ncol):
                s[r, c] = cute.math.exp2(s[r, c] * scale_e + neg_max_scaled, fastmath=True)
            block_sum = s[r, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = block_sum
            else:
                # (m_prev - m_safe) is -inf when m_prev is -inf: the factor is 0, as is the
                # output and sum it rescales.
                sc = cute.math.exp2((self.row_max[r] - m_safe) * self.scale_log2, fastmath=True)
                row_scale[r] = sc
                self.row_sum[r] = self.row_sum[r] * sc + block_sum
            self.row_max[r] = m
        return row_scale

    @cute.jit
    def step_lazy(self, acc_s: cute.Tensor):
        """`step` (not the first block) with conditional rescaling: a row keeps its reference
        max until the block's max exceeds it by more than ``LAZY_RESCALE_LOG2`` (log2 units;
        0: any growth), and the output / sum are rescaled only when a reference moves.
        Returns (row_scale, whether any row of the warp moved: the caller skips the O
        rescale otherwise; with threshold 0 the skipped factors are exactly 1)."""
        s = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        ncol = cute.size(s, mode=[1])
        assert ncol % 4 == 0
        moved = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(self.num_rows):
            m = quad_allreduce_max(cute.arch.fmax(_row_max(s, r, ncol), self.row_max[r]))
            prev = self.row_max[r]
            # -inf reference (nothing visible yet) and a finite max: +inf > threshold, moves;
            # both -inf: NaN, compares false, stays (its probabilities are exp2(-inf) = 0).
            grow = (m - prev) * self.scale_log2 > Float32(LAZY_RESCALE_LOG2)
            m_safe = Float32(cutlass.select_(m == -Float32.inf, Float32(0.0), m))
            sc = Float32(cutlass.select_(
                grow, cute.math.exp2((prev - m_safe) * self.scale_log2, fastmath=True),
                Float32(1.0)))
            ref = Float32(cutlass.select_(grow, m, prev))
            self.row_max[r] = ref
            moved = moved | grow
            ref = Float32(cutlass.select_(ref == -Float32.inf, Float32(0.0), ref))
            neg_ref_scaled = -ref * self.scale_log2
            if cutlass.const_expr(self.p_shift_log2 != 0):
                neg_ref_scaled = neg_ref_scaled + Float32(self.p_shift_log2)
            for c in cutlass.range_constexpr(ncol):
                s[r, c] = cute.math.exp2(s[r, c] * self.scale_log2 + neg_ref_scaled,
                                         fastmath=True)
            block_sum = s[r, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            row_scale[r] = sc
            self.row_sum[r] = self.row_sum[r] * sc + block_sum
        return row_scale, cute.arch.vote_any_sync(moved)

    @cute.jit
    def finalize(self, lse_out: cute.Tensor) -> cute.Tensor:
        """Return 1/row_sum per row (1 for empty rows) and write natural-log LSE per row into
        ``lse_out`` (-inf for rows that saw no key)."""
        inv = cute.make_rmem_tensor(cute.make_layout(self.num_rows), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce_sum(self.row_sum[r])
            m = self.row_max[r]
            inv_r = Float32(1.0)
            lse_r = -Float32.inf
            # total is 0 for a row with no visible key and NaN never; keep such rows at 0/-inf.
            if total > Float32(0.0):
                inv_r = cute.arch.rcp_approx(total)
                lse_r = (m * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
                if cutlass.const_expr(self.p_shift_log2 != 0):
                    lse_r = lse_r - Float32(self.p_shift_log2 * LN2)
            inv[r] = inv_r
            lse_out[r] = lse_r
        return inv


@cute.jit
def rescale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """acc_o[r, :] *= row_scale[r] on an accumulator fragment."""
    o = acc_as_rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]
