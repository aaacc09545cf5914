"""Tile order for the forward kernels: which (m_block, head, batch) a CTA computes.

One CTA per tile, a 1-D grid (no limit on batch * heads from grid.y/z), and the order in which
the hardware launches CTAs (increasing blockIdx.x) chosen for the two regimes:

- non-causal: all tiles cost the same; m blocks of one head are adjacent so the CTAs running
  together share that head's K/V in L2.
- causal / window: tile cost grows with m. Heads are cut into sections small enough that the
  sections' K/V stay in L2, and inside a section tiles go longest-first (largest m first, the
  LPT rule), so the short tiles fill the tail of the wave instead of the long ones.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jaxflash.kernels.carry import Carried

# CTAs of a persistent launch: one per SM of an H100/H200 SXM (132). A GPU with fewer SMs still
# runs every tile (CTAs then share SMs), just less evenly.
NUM_SMS = 132


class TileScheduler(Carried):
    """Static (no runtime state): carried through control flow as nothing."""

    def __init__(self, lpt: bool, section_bytes: int = 24 * 1024 * 1024):
        self.lpt = lpt
        self.section_bytes = section_bytes

    @staticmethod
    def num_tiles(num_m_blocks, num_heads, batch):
        return num_m_blocks * num_heads * batch

    @cute.jit
    def tile_of_round(self, r: Int32, cta: Int32, grid: Int32):
        """Linear tile a CTA takes in its r-th round (persistent: CTA c takes one tile of each
        run of `grid`). With LPT order the runs go alternately forward and backward (snake),
        so every CTA gets the same mix of long and short tiles."""
        t = r * grid + cta
        if cutlass.const_expr(self.lpt):
            if r % 2 == 1:
                t = r * grid + (grid - 1 - cta)
        return t

    @cute.jit
    def decode(self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
               kv_bytes_per_head: Int32):
        """Return (m_block, head, batch_idx) of linear tile index ``tile``."""
        m_block = Int32(0)
        hb = Int32(0)
        if cutlass.const_expr(not self.lpt):
            m_block = tile % num_m_blocks
            hb = tile // num_m_blocks
        else:
            total_hb = num_heads * batch
            section = cutlass.max(Int32(self.section_bytes) // cutlass.max(kv_bytes_per_head, 1), 1)
            section = cutlass.min(section, total_hb)
            per_section = section * num_m_blocks
            sec_idx = tile // per_section
            rem = tile - sec_idx * per_section
            first_hb = sec_idx * section
            width = cutlass.min(section, total_hb - first_hb)  # the last section may be short
            m_block = num_m_blocks - 1 - rem // width
            hb = first_hb + rem % width
        head = hb % num_heads
        b = hb // num_heads
        return m_block, head, b
