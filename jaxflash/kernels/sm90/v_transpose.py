"""V's transpose for the FP8 PV GEMM, in shared memory, by the producer warpgroup.

FP8 wgmma reads both operands K-major, and for O = P V the k index is the key: V must sit with
the keys contiguous, while TMA loads it as it lies in global memory (head dim contiguous). The
producer warpgroup moves each loaded stage (keys x Hv, bytes) into a (Hv x keys) buffer.

The key order is permuted on the way, so that P needs no data movement between threads: a
thread's fp32 score accumulator holds, per 16 keys, columns {2q, 2q+1, 2q+8, 2q+9} (q = lane %
4) of its rows, while the FP8 A operand wants 4 consecutive k positions {4q .. 4q+3} per 32-bit
register. So A position 16c + 4q + i is given the key 16c + 2q + (i % 2) + 8 (i // 2): P's four
values are packed as they lie (`layouts.acc_as_fp8_operand_a`), and V's rows are written in the
same order here. The product sums over keys, so a common permutation leaves O unchanged.

Each thread moves 4 x 4 byte blocks: 4 keys {2q, 2q+1, 2q+8, 2q+9} (+16c) x 4 head-dim bytes
read as four 32-bit words, byte-transposed with 8 PRMTs, written as four 32-bit words (4 head-dim
rows x the 4 consecutive permuted key positions 4q .. 4q+3). A warp's lanes cover 4 q x 2 chunks
x 4 head-dim groups, so each access touches 8 rows of the swizzled tiles. Addresses go through
the tiles' own (swizzled) layouts.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# PRMT selectors: interleave the low (0x5140) / high (0x7362) byte pairs of two words, and the
# low (0x5410) / high (0x7632) halves.
_LO_BYTES, _HI_BYTES, _LO_HALVES, _HI_HALVES = 0x5140, 0x7362, 0x5410, 0x7632
# the keys of one 32-bit A register, relative to 16c + 2q
KEY_OFFSETS = (0, 1, 8, 9)


def _prmt(a, b, sel: int) -> Int32:
    return Int32(cute.arch.prmt(a, b, Int32(sel)))


@cute.jit
def transpose_stage(raw_words: cute.Tensor, vt_words: cute.Tensor, raw_layout, vt_layout,
                    raw_stage: Int32, vt_stage: Int32, tidx: Int32,
                    tile_n: cutlass.Constexpr, hdv: cutlass.Constexpr,
                    num_warps: cutlass.Constexpr):
    """Transpose stage ``raw_stage`` of the loaded V (layout ``raw_layout``: (keys, Hv,
    stages) bytes, swizzled) into stage ``vt_stage`` of V^T (``vt_layout``: (Hv, keys,
    stages)), keys permuted as described above. ``raw_words`` / ``vt_words``: the same buffers
    as flat Int32 tensors. Called by ``num_warps`` whole warps, ``tidx`` in [0, 32 num_warps)."""
    lane = tidx % 32
    warp = tidx // 32
    q = lane % 4
    c_lo = (lane // 4) % 2
    d_lo = lane // 8
    n_dh = hdv // 16
    per_warp = (tile_n // 32) * n_dh // num_warps
    # A runtime loop (unrolled twice): fully unrolled, ptxas hoists every block's addresses
    # and the 24-register producer spills (hd 256).
    for it in cutlass.range(per_warp, unroll=2):
        combo = warp * per_warp + it
        ch = combo // n_dh
        dh = combo - ch * n_dh
        c = 2 * ch + c_lo
        d0 = 4 * (4 * dh + d_lo)
        key0 = 16 * c + 2 * q
        w0 = raw_words[cute.crd2idx((key0 + KEY_OFFSETS[0], d0, raw_stage), raw_layout) >> 2]
        w1 = raw_words[cute.crd2idx((key0 + KEY_OFFSETS[1], d0, raw_stage), raw_layout) >> 2]
        w2 = raw_words[cute.crd2idx((key0 + KEY_OFFSETS[2], d0, raw_stage), raw_layout) >> 2]
        w3 = raw_words[cute.crd2idx((key0 + KEY_OFFSETS[3], d0, raw_stage), raw_layout) >> 2]
        # bytes of w_r: head dims d0 .. d0+3 of key r; out word i: key 0..3 of head dim d0+i
        t0 = _prmt(w0, w1, _LO_BYTES)  # w0.b0 w1.b0 w0.b1 w1.b1
        t1 = _prmt(w0, w1, _HI_BYTES)  # w0.b2 w1.b2 w0.b3 w1.b3
        t2 = _prmt(w2, w3, _LO_BYTES)
        t3 = _prmt(w2, w3, _HI_BYTES)
        col = 16 * c + 4 * q
        vt_words[cute.crd2idx((d0 + 0, col, vt_stage), vt_layout) >> 2] = _prmt(t0, t2, _LO_HALVES)
        vt_words[cute.crd2idx((d0 + 1, col, vt_stage), vt_layout) >> 2] = _prmt(t0, t2, _HI_HALVES)
        vt_words[cute.crd2idx((d0 + 2, col, vt_stage), vt_layout) >> 2] = _prmt(t1, t3, _LO_HALVES)
        vt_words[cute.crd2idx((d0 + 3, col, vt_stage), vt_layout) >> 2] = _prmt(t1, t3, _HI_HALVES)
