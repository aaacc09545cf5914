"""The forward kernel's score transforms and masks on one block's S accumulator, and the
mods' block range table. Mixin of `FlashFwdSm90` (reads ``cfg``, ``tile_m``, ``tile_n``,
``mask_by_select``); split from `sm90.fwd` to keep that module to the kernel's structure.

Mods (`FwdConfig.score_mod` / ``mask_mod``): the score_mod program runs on every block, on
the scaled logits (the kernel then takes the softmax in natural-log units); the mask_mod
program only on the blocks the tile's range table row marks partial (`mod_regions`), before
the built-in bounds. Without mods nothing here emits code the built-ins did not.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from jaxflash.kernels.common.mask import apply_alibi, apply_mask, apply_segment_mask
from jaxflash.kernels.common.mod_emit import apply_mask_mod, apply_score_mod
from jaxflash.kernels.variants.mod_program import kernel_programs

LOG2_E = math.log2(math.e)


class FwdScores:
    @property
    def has_score_mod(self) -> bool:
        return bool(self.cfg.score_mod)

    @property
    def has_mask_mod(self) -> bool:
        return bool(self.cfg.mask_mod)

    @property
    def has_mods(self) -> bool:
        return self.has_score_mod or self.has_mask_mod

    def mod_scales(self, softmax_scale):
        """(the factor on the raw scores, the exp2 factor) with a score_mod: the program
        takes the scaled logit (times its constant in_scale) and gives the logit (over its
        out_scale), so the softmax runs in natural-log units times out_scale."""
        _sp, _mp, _names, (a, c) = kernel_programs(self.cfg.score_mod, "")
        pre = softmax_scale if a == 1.0 else softmax_scale * Float32(a)
        return pre, Float32(LOG2_E * c)

    @cute.jit
    def mod_row(self, mModBlk, batch: Int32, head: Int32, m_block: Int32):
        """This tile's row of the mask_mod block table: (n_min, full_lo, full_hi, n_max).
        Dims of size 1 broadcast (a mod that ignores the batch or the head)."""
        b = cutlass.min(batch, mModBlk.shape[0] - 1)
        h = cutlass.min(head, mModBlk.shape[1] - 1)
        return (mModBlk[b, h, m_block, 0], mModBlk[b, h, m_block, 1],
                mModBlk[b, h, m_block, 2], mModBlk[b, h, m_block, 3])

    def mod_right(self, mods, n_right: Int32):
        """The built-in right-path start narrowed by the mask_mod table: blocks >= it need a
        mask (`mod_left`: below its result). Between the two the blocks are full for both and
        run with no mask. Plain Python (inlined while tracing)."""
        if const_expr(self.has_mask_mod):
            if const_expr(self.has_right):
                n_right = cutlass.min(n_right, mods.full_hi)
            else:
                n_right = mods.full_hi
        return n_right

    def mod_left(self, mods, n_left: Int32):
        """See `mod_right`: blocks below the result take the left (masked) path."""
        if const_expr(self.has_mask_mod):
            n_left = cutlass.max(n_left, mods.full_lo)
        return n_left

    @cute.jit
    def scores(self, acc_S, tScS, m_block: Int32, n_block: Int32, seqlen_k: Int32,
               pre_scale, window_left: Int32, window_right: Int32, mods, seg_cmp,
               mask_seqlen: cutlass.Constexpr, mask_right: cutlass.Constexpr,
               mask_left: cutlass.Constexpr, mask_mod: cutlass.Constexpr = False):
        """Logit transforms (softcap, ALiBi, score_mod) then masks (mask_mod, segments,
        bounds), in place on the S accumulator."""
        if const_expr(self.cfg.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * pre_scale, fastmath=True)
        if const_expr(self.cfg.has_alibi):
            apply_alibi(acc_S, tScS, m_block * self.tile_m, n_block * self.tile_n, mods.alibi)
        sp, mp, names, _ = kernel_programs(self.cfg.score_mod, self.cfg.mask_mod)
        if const_expr(sp is not None):
            # pre_scale: the softmax scale (times the program's in_scale, `mod_scales`)
            apply_score_mod(sp, dict(zip(names, mods.aux)), acc_S, tScS, m_block * self.tile_m,
                            n_block * self.tile_n, mods.batch, mods.head, pre_scale)
        if const_expr(mask_mod and mp is not None):
            apply_mask_mod(mp, dict(zip(names, mods.aux)), acc_S, tScS, m_block * self.tile_m,
                           n_block * self.tile_n, mods.batch, mods.head)
        if const_expr(self.cfg.has_segments):
            # Most blocks of packed documents lie inside one document: no compare there.
            if seg_cmp:
                apply_segment_mask(acc_S, tScS, mods.rows, n_block * self.tile_n, mods.kv_seg,
                                   mods.S)
        if const_expr(mask_seqlen or mask_right or mask_left):
            apply_mask(acc_S, tScS, m_block, n_block, self.tile_m, self.tile_n, seqlen_k,
                       window_left, window_right, mask_seqlen, mask_right, mask_left,
                       by_select=self.mask_by_select, skip_full=self.cfg.mask_skip)

    @cute.jit
    def segment_compare_needed(self, mods, n_block: Int32):
        """Whether block n_block needs the segment element compare (None without segments).
        Called before the block's QK GEMM is issued, so the two summary loads are in flight
        under the GEMM instead of stalling the softmax after it."""
        need = None
        if const_expr(self.cfg.has_segments):
            need = mods.rows.block_needs_compare(mods.kv_blk[n_block, 0],
                                                 mods.kv_blk[n_block, 1])
        return need
