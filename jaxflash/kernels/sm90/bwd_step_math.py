"""The backward step's elementwise math, shared by every Hopper backward kernel
(`FlashBwdSm90`, `FlashBwdSm90Wide`): P^T from S^T and the LSE rows, dS^T
from dP^T and the delta rows (times the softcap or score_mod derivative), the ALiBi slope
gradient, and the mods on a transposed block (`mod_scores`; rows = keys).

The tiles are transposed (rows = keys, columns = queries), so every per-query value (lse2,
delta) is read once per column from shared memory. Masked scores hold -inf before the
exponential: P = dS = 0 there, never NaN (queries with no visible key arrive with lse2 = +inf).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from jaxflash.kernels.common import layouts
from jaxflash.kernels.common.mask import TileCoords, alibi_distance_dot
from jaxflash.kernels.common.mod_emit import apply_mask_mod, apply_score_mod
from jaxflash.kernels.variants.mod_program import kernel_programs

LOG2_E = math.log2(math.e)


class BwdStepMath:
    """Mixin of `FlashBwdSm90`: needs ``cfg``, ``dtype``, ``tile_m`` and ``tile_n``."""

    @property
    def has_score_mod(self) -> bool:
        return bool(self.cfg.score_mod)

    @property
    def has_mods(self) -> bool:
        return bool(self.cfg.score_mod) or bool(self.cfg.mask_mod)

    @property
    def mod_dscore(self):
        """The score_mod's derivative by the score when it is a constant (an additive bias
        such as ALiBi or T5: 1), else None."""
        sp = kernel_programs(self.cfg.score_mod, "")[0]
        if sp is None or isinstance(sp.outs[1], str):
            return None
        return float(sp.outs[1][0])

    @property
    def folds_dscore(self) -> bool:
        """Whether `mod_scores` folds a per-element derivative into dP^T."""
        return self.has_score_mod and self.mod_dscore is None

    def mod_scales(self, softmax_scale):
        """As the forward's `FwdScores.mod_scales` (the score program here is the value and
        derivative one; its own constant factors)."""
        _sp, _mp, _names, (a, c) = kernel_programs(self.cfg.score_mod, "")
        pre = softmax_scale if a == 1.0 else softmax_scale * Float32(a)
        return pre, Float32(LOG2_E * c)

    @cute.jit
    def mod_m_range(self, mModBlk, batch: Int32, kv_head: Int32, n_block: Int32,
                    m_min: Int32, m_max: Int32):
        """[m_min, m_max) narrowed to the query blocks the mask_mod leaves visible (not with
        ``deterministic``: its dQ order counts every key block of the geometric range)."""
        if const_expr(mModBlk is not None and not self.cfg.deterministic):
            b = cutlass.min(batch, mModBlk.shape[0] - 1)
            h = cutlass.min(kv_head, mModBlk.shape[1] - 1)
            m_min = cutlass.max(m_min, mModBlk[b, h, n_block, 0])
            m_max = cutlass.max(cutlass.min(m_max, mModBlk[b, h, n_block, 3]), m_min)
        return m_min, m_max

    @cute.jit
    def mod_full_range(self, mModBlk, batch: Int32, kv_head: Int32, n_block: Int32):
        """(first, end) of the query blocks the mask_mod leaves fully visible (None without)."""
        full = None
        if const_expr(mModBlk is not None):
            b = cutlass.min(batch, mModBlk.shape[0] - 1)
            h = cutlass.min(kv_head, mModBlk.shape[1] - 1)
            full = (mModBlk[b, h, n_block, 1], mModBlk[b, h, n_block, 2])
        return full

    @cute.jit
    def mod_scores(self, acc_S, acc_dP, coords: TileCoords, sDelta, stage: Int32,
                   n_block: Int32, m_block: Int32, batch: Int32, head: Int32, mods,
                   scale: Float32, full):
        """The mods on one S^T block: score_mod, then mask_mod unless the block is in the full
        range. A per-element derivative of the score_mod goes straight into dP^T, which
        becomes (dP^T - delta) * d score_mod / d score (`probs_and_grads` then skips delta):
        no third fragment live beside S^T and dP^T (it spilled at hd 128), at the price of
        waiting for the dP^T GEMM first. A constant derivative (additive biases) needs none
        of that."""
        sp, mp, names, _ = kernel_programs(self.cfg.score_mod, self.cfg.mask_mod)
        aux = dict(zip(names, mods[1]))
        if const_expr(self.has_mods):  # the mods see global indices (a shard's offsets)
            batch = batch + mods[2][0]
            head = head + mods[2][1]
        if const_expr(self.folds_dscore):
            warpgroup.wait_group(0)
            apply_score_mod(sp, aux, acc_S, coords, n_block * self.tile_n,
                            m_block * self.tile_m, batch, head, scale, True,
                            _delta_fold(acc_dP, coords, sDelta, stage))
        elif const_expr(sp is not None):  # a constant derivative: `probs_and_grads` applies it
            apply_score_mod(sp, aux, acc_S, coords, n_block * self.tile_n,
                            m_block * self.tile_m, batch, head, scale, True)
        if const_expr(mp is not None):
            if (m_block < full[0]) | (m_block >= full[1]):
                apply_mask_mod(mp, aux, acc_S, coords, n_block * self.tile_n,
                               m_block * self.tile_m, batch, head, True)

    def probs_and_grads_lowp(self, acc_S, acc_dP, coords: TileCoords, sLSE, sDelta,
                             stage: Int32, scale_log2: Float32):
        """`probs_and_grads`, then P^T and dS^T in the input dtype (the RS operands of dV and
        dK). Plain Python (inlined while `consume` is traced)."""
        self.probs_and_grads(acc_S, acc_dP, coords, sLSE, sDelta, stage, scale_log2)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        return rP, rdS

    @cute.jit
    def alibi_grad_step(self, acc_dS, coords: TileCoords, n_block: Int32, m_block: Int32,
                        m_last: Int32, head: Int32, batch: Int32, warp_idx: Int32,
                        mdAlibi: cute.Tensor, dslope: Float32):
        """Add this step's sum dS_ij |i - j| to the thread's running d(slope) partial; after
        the head's last query block, reduce it over the warp, let lane 0 write
        alibi_parts[batch, head, n_block, consumer warp] and restart from 0."""
        dslope = alibi_distance_dot(acc_dS, coords, n_block * self.tile_n,
                                    m_block * self.tile_m, dslope)
        if m_block == m_last:
            total = cute.arch.warp_reduction_sum(dslope)
            if cute.arch.lane_idx() == 0:
                mdAlibi[batch, head, n_block, warp_idx - 4] = total
            dslope = Float32(0.0)
        return dslope

    @cute.jit
    def probs_and_grads(self, acc_S, acc_dP, coords: TileCoords, sLSE, sDelta, stage: Int32,
                        scale_log2: Float32):
        """In place: acc_S <- P^T = exp2(S^T * scale_log2 - lse2[query]) and
        acc_dP <- dS^T = P^T * (dP^T - delta[query]) (* (1 - t^2) with softcap, where acc_S
        held t = tanh(.)), or P^T * acc_dP with a score_mod whose derivative `mod_scores`
        folded in with delta (a constant derivative multiplies here instead). Columns are
        queries: each column's lse2/delta is read once."""
        s = layouts.acc_as_rows_cols(acc_S)
        dp = layouts.acc_as_rows_cols(acc_dP)
        t0 = coords.t0
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = coords.base_col + t0[0, j][1]
            lse2 = sLSE[col, stage]
            delta = None
            if const_expr(not self.folds_dscore):
                delta = sDelta[col, stage]
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                x = s[r, j]
                p = cute.math.exp2(x * scale_log2 - lse2, fastmath=True)
                if const_expr(self.folds_dscore):
                    ds = p * dp[r, j]
                else:
                    ds = p * (dp[r, j] - delta)
                if const_expr(self.has_score_mod and self.mod_dscore not in (None, 1.0)):
                    ds = ds * Float32(self.mod_dscore)
                if const_expr(self.cfg.has_softcap):
                    # d(c tanh(u))/du = c (1 - t^2); masked entries hold -inf: clamp to -1 so the
                    # factor is 0 there instead of NaN (p is 0 as well).
                    t = cute.arch.fmax(x, Float32(-1.0))
                    ds = ds * (Float32(1.0) - t * t)
                s[r, j] = p
                dp[r, j] = ds

    @cute.jit
    def probs(self, acc_S, coords: TileCoords, sLSE, stage: Int32, scale_log2: Float32):
        """In place: acc_S <- P^T = exp2(S^T * scale_log2 - lse2[query]) (`early_dv`)."""
        s = layouts.acc_as_rows_cols(acc_S)
        t0 = coords.t0
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            lse2 = sLSE[coords.base_col + t0[0, j][1], stage]
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                s[r, j] = cute.math.exp2(s[r, j] * scale_log2 - lse2, fastmath=True)

    @cute.jit
    def grads(self, acc_P, acc_dP, rT, coords: TileCoords, sDelta, stage: Int32):
        """In place: acc_dP <- dS^T = P^T * (dP^T - delta[query]) (* (1 - t^2) with softcap,
        t = tanh(.) kept in rT) (`early_dv`)."""
        p = layouts.acc_as_rows_cols(acc_P)
        dp = layouts.acc_as_rows_cols(acc_dP)
        t0 = coords.t0
        tt = None
        if const_expr(self.cfg.has_softcap):
            tt = layouts.acc_as_rows_cols(rT)
        for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
            delta = sDelta[coords.base_col + t0[0, j][1], stage]
            for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                ds = p[r, j] * (dp[r, j] - delta)
                if const_expr(self.cfg.has_softcap):
                    t = cute.arch.fmax(tt[r, j], Float32(-1.0))  # masked: -inf -> factor 0
                    ds = ds * (Float32(1.0) - t * t)
                dp[r, j] = ds


def _delta_fold(acc_dP, coords: TileCoords, sDelta, stage):
    """`mod_emit.apply_score_mod`'s grad callback: dP^T[r, j] <- (dP^T[r, j] - delta) * g.
    Plain Python (a closure the DSL must not rewrite): one shared-memory read of delta per
    column, as the emission walks columns outermost."""
    dp = layouts.acc_as_rows_cols(acc_dP)
    t0 = coords.t0
    deltas = {}

    def fold(r, j, g):
        if j not in deltas:
            deltas[j] = sDelta[coords.base_col + t0[0, j][1], stage]
        dp[r, j] = (dp[r, j] - deltas[j]) * g

    return fold
