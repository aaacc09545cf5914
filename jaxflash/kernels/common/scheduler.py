"""Tile order for the forward kernels: which (m_block, head, batch) a CTA computes.

One CTA per tile, a 1-D grid (no limit on batch * heads from grid.y/z), and the order in which
the hardware launches CTAs (increasing blockIdx.x) chosen for the two regimes:

- non-causal: all tiles cost the same; m blocks of one head are adjacent so the CTAs running
  together share that head's K/V in L2.
- causal / window: tile cost grows with m. Heads are cut into sections small enough that the
  sections' K/V stay in L2, and inside a section tiles go longest-first (largest m first, the
  LPT rule), so the short tiles fill the tail of the wave instead of the long ones.
- ``pairs`` (persistent with the tile pipe, causal / window): a CTA takes tiles two by two,
  tile m and tile nm - 1 - m of one head, so every pair costs about nm + 1 key blocks and a
  static round-robin of pairs balances the CTAs. The LPT order dealt round-robin to a fixed
  set of persistent CTAs does not: at D=128 S=1k causal its busiest CTA gets 1.19x the mean
  work (a model of the order, `devtools.sched_model`), pairs 1.03x. The order
  runs over *slots* (2 per pair); with an odd nm the middle tile's second slot is empty and
  the producer skips it (hence the tile pipe, which tells the consumers only real tiles).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jaxflash.kernels.common.carry import Carried

# CTAs of a persistent launch: one per SM of an H100/H200 SXM (132). A GPU with fewer SMs still
# runs every tile (CTAs then share SMs), just less evenly.
NUM_SMS = 132


class TileScheduler(Carried):
    """Static (no runtime state): carried through control flow as nothing."""

    def __init__(self, lpt: bool, section_bytes: int = 24 * 1024 * 1024, pairs: bool = False):
        self.lpt = lpt
        self.section_bytes = section_bytes
        self.pairs = pairs

    @staticmethod
    def num_tiles(num_m_blocks, num_heads, batch):
        return num_m_blocks * num_heads * batch

    def num_slots(self, num_m_blocks, num_heads, batch):
        """Length of the linear order `tile_of_round` walks: the tiles, or with ``pairs`` two
        slots per pair ((num_m_blocks + 1) // 2 pairs per head)."""
        if self.pairs:  # (a Python flag: fixed per compiled variant)
            return (num_m_blocks + 1) // 2 * 2 * num_heads * batch
        return num_m_blocks * num_heads * batch

    @cute.jit
    def tile_of_round(self, r: Int32, cta: Int32, grid: Int32):
        """Linear tile a CTA takes in its r-th round (persistent: CTA c takes one tile of each
        run of `grid`). With LPT order the runs go alternately forward and backward (snake),
        so every CTA gets the same mix of long and short tiles."""
        t = r * grid + cta
        if cutlass.const_expr(self.pairs):
            # Both slots of pair-round q = r // 2 go to the same CTA, pair rounds snake.
            q = r // 2
            k = cta
            if q % 2 == 1:
                k = grid - 1 - cta
            t = (q * grid + k) * 2 + r % 2
        elif cutlass.const_expr(self.lpt):
            if r % 2 == 1:
                t = r * grid + (grid - 1 - cta)
        return t

    @cute.jit
    def decode(self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
               kv_bytes_per_head: Int32):
        """Return (m_block, head, batch_idx) of linear tile index ``tile`` (with ``pairs`` of
        slot ``tile``; m_block -1 for the empty second slot of an odd head's middle tile)."""
        m_block = Int32(0)
        hb = Int32(0)
        if cutlass.const_expr(self.pairs):
            per_head = (num_m_blocks + 1) // 2
            unit = tile // 2
            hb = unit // per_head
            p = unit - hb * per_head
            # The long tile of the pair first, the short one last (the CTA's tail).
            m_block = num_m_blocks - 1 - p
            if tile % 2 == 1:
                m_block = p
                if p == num_m_blocks - 1 - p:
                    m_block = Int32(-1)
        elif cutlass.const_expr(not self.lpt):
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
