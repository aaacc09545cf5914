"""FP8 (e4m3) FlashAttention forward for Blackwell (sm_100a): `FlashFwdSm100Fp8`.

The 16-bit Blackwell forward (`sm100.fwd.FlashFwdSm100`: warp roles, TMA loads, S / P / O in
tensor memory, masks, conditional O correction, epilogue) with e4m3 operands, through the base
class's compile-time hooks. What changes:

- Both MMAs are ``tcgen05.mma ... kind::f8f6f4`` (e4m3 x e4m3, float32 accumulate, K = 32).
  tcgen05 reads 8-bit B operands MN-major from shared memory, so V is loaded as it lies
  (head dim contiguous) and needs no transpose (Hopper's FP8 wgmma does: `sm90.v_transpose`).
- P = exp2(score - max) x 2^8 (``p_shift_log2``: the exp2's argument gets + 8), converted to
  e4m3 (packed ``cvt.rn.satfinite.e4m3x2.f32``) and stored over S in tensor memory, four to a
  column; the PV MMA reads it from there. The row sum carries the 2^8 (it cancels in O), the
  LSE takes it out. The reference max is exact (``rescale_threshold`` 0), so P <= 2^8 < 448.
- Dequantization scales, [B, heads, nb] float32 (the FP8 contract's canonical layout): q's
  (one per tile) and k's (unless per key block) fold into the exp2 scale, or into the softcap's
  pre-scale; per-block k scales multiply each block's scores (packed multiplies); per-block v
  scales fold the ratio v[j + 1] / v[j] into the O correction of block j (O accumulates in the
  current block's v units), the last block's into 1 / rowsum; a single v scale goes there too.
- O leaves in ``out_dtype`` (bfloat16 / float16).

Compiled and instruction-checked only: no Blackwell GPU has run it (gated in
`policy.verified`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jaxflash.kernels.common.launch_args import LaunchArgs, mask_inputs
from jaxflash.kernels.sm100.fwd import FlashFwdSm100
from jaxflash.kernels.variants.fwd import FLOAT_SCALARS, INT_SCALARS
from jaxflash.kernels.variants.fwd_fp8 import DESCALES
from jaxflash.kernels.variants.sm100_fwd_fp8 import P_SHIFT_LOG2, Sm100Fp8FwdConfig

_OUT = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class FlashFwdSm100Fp8(FlashFwdSm100):
    """Blackwell FP8 forward for one `Sm100Fp8FwdConfig` variant.

    Host entry: the Hopper FP8 kernel's argument order (q, k, v e4m3 row-major, [q_seqlen],
    [kv_seqlen], [segments x 4], q_descale [B, N, nq], k_descale [B, K, nk], v_descale
    [B, K, nv] float32, o (out_dtype), lse, float scalars, [int scalars], stream).
    """

    DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN}

    def __init__(self, config: Sm100Fp8FwdConfig):
        super().__init__(config)
        self.o_dtype = _OUT[config.out_dtype]
        self.p_shift_log2 = P_SHIFT_LOG2

    def launch_layout(self):
        ins = ["q", "k", "v"]
        ins += mask_inputs(self.cfg)
        ins += list(DESCALES)
        return tuple(ins), ("o", "lse"), FLOAT_SCALARS, INT_SCALARS if self.cfg.has_window else ()

    @cute.jit
    def __call__(self, *args):
        a = LaunchArgs(args, f"FlashFwdSm100Fp8({self.cfg.key})")
        mQ, mK, mV = a.take(3)
        mQSeqlen = a.maybe(self.cfg.has_q_seqlen)
        mKVSeqlen = a.maybe(self.cfg.has_kv_seqlen)
        seg = a.maybe(self.cfg.has_segments, 4)
        mQD, mKD, mVD = a.take(3)
        mO, mLSE, mFScalars = a.take(3)
        mIScalars = a.maybe(self.cfg.has_window)
        stream = a.stream()
        for t in (mQD, mKD, mVD):
            if cutlass.const_expr(t.element_type != Float32):
                raise TypeError(f"the descales must be float32, got {t.element_type}")
        self.launch(mQ, mK, mV, mQSeqlen, mKVSeqlen, None, seg[0], seg[1], seg[2], seg[3], mO,
                    mLSE, mFScalars, mIScalars, stream, mQD, mKD, mVD)

    # ---------------------------------------------------------------- hooks
    def fold_descales(self, mQD, mKD, m_block, head, kv_head, batch, scale_log2, pre_scale):
        """q's scale (one per tile) and k's (unless per key block) into the exp2 scale, or,
        with softcap, into the tanh's argument: tanh(S * descale * scale / softcap)."""
        d = mQD[batch, head, m_block if self.cfg.q_blocks else Int32(0)]
        if not self.cfg.k_blocks:
            d = d * mKD[batch, kv_head, 0]
        if self.cfg.has_softcap:
            return scale_log2, pre_scale * d
        return scale_log2 * d, pre_scale

    def output_descale(self, mVD, kv_head, batch, n_min):
        """V's scale of the last block visited (the leftmost, n_min: O is in its units), or
        the one scale of the (batch, head)."""
        idx = Int32(0)
        if self.cfg.v_blocks:
            idx = cutlass.min(n_min, mVD.shape[2] - 1)
        return mVD[batch, kv_head, idx]

    def descale_mods(self, mods, desc) -> list:
        mKD, mVD, kv_head, batch = desc
        dyn = []
        if self.cfg.k_blocks:
            mods.kd = mKD[batch, kv_head, None]
            dyn.append("kd")
        if self.cfg.v_blocks:
            mods.vd = mVD[batch, kv_head, None]
            dyn.append("vd")
        return dyn

    def block_scores(self, rS, mods, n_block):
        """Per-block k scales: each score of block n_block times its scale (packed)."""
        if self.cfg.k_blocks:
            kd = mods.kd[n_block]
            for i in range(0, cute.size(rS), 2):
                rS[i], rS[i + 1] = cute.arch.mul_packed_f32x2((rS[i], rS[i + 1]), (kd, kd))

    def o_rescale(self, acc_scale, mods, n_block):
        """Per-block v scales: O holds the blocks right of n_block in the v units of block
        n_block + 1 (visited just before); PV of n_block comes next, so O moves to its units.
        (On a tile's first block O is empty and not rescaled.)"""
        if not self.cfg.v_blocks:
            return acc_scale
        prev = cutlass.min(n_block + 1, cute.size(mods.vd) - 1)
        # (an approximate reciprocal, 1 ulp: an IEEE division's slow path is a call, which
        # spills beside the row of scores in registers)
        return acc_scale * (mods.vd[prev] * cute.arch.rcp_approx(mods.vd[n_block]))
