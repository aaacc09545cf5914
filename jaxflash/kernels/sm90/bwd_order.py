"""Which (key block, kv head, batch) a backward CTA computes: the launch order (device code).

The backward launches one CTA per key block of each (kv head, batch), x = key block fastest,
and the hardware starts CTAs in launch order as SMs free up. Under a causal mask key block n
has fewer query blocks the larger n is, so head after head the order runs long -> short, and
the *last* heads' longest CTAs start in the final wave: the busiest SM ends ~6-7% after the
mean at D=128 / 256 S = 1k / 4k (a list-scheduling model of the launch,
`devtools.sched_model`). `BwdConfig.tail_lpt` keeps that order for all but the last few heads
and launches those key-block-major (every tail head's block 0, then every block 1, ...), so the
final wave ends with short CTAs (model: 1.01-1.02). Only the tail is reordered, so the heads
whose CTAs run together still share Q / dO and their dQ accumulator in L2: the tail's heads
are as many as fit an L2 budget (Q, dO and the float32 dQ rows of a head).

With `BwdConfig.q_multicast` the CTAs come in clusters of two adjacent key blocks (grid x
even, a cluster = x 2j and 2j + 1): the order is then that of the pairs, and both CTAs of a
cluster take key blocks 2j' and 2j' + 1 of one head (``pair``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TAIL_L2_BYTES = 24 * 1024 * 1024  # what the reordered heads' Q / dO / dQ rows may occupy


@cute.jit
def block_coords(T: Int32, row_bytes: cutlass.Constexpr[int], pair: cutlass.Constexpr[int] = 1):
    """(n_block, kv_head, batch) of this CTA with the tail reordered (see the module).
    ``row_bytes``: bytes of Q, dO and dQ per query row and head; ``pair``: CTAs per cluster
    (key blocks that must stay adjacent: 1, or 2 under q_multicast)."""
    x, y, z = cute.arch.block_idx()
    nn, K, B = cute.arch.grid_dim()
    rank = Int32(0)
    if cutlass.const_expr(pair > 1):  # order the pairs; the rank picks the block within one
        rank = x % pair
        x = x // pair
        nn = nn // pair
    linear = x + nn * (y + K * z)
    heads = K * B
    tail = cutlass.min(cutlass.max(Int32(TAIL_L2_BYTES) // cutlass.max(T * row_bytes, 1), 1),
                       heads)
    start = (heads - tail) * nn
    hb = linear // nn
    n = linear - hb * nn
    if linear >= start:
        r = linear - start
        n = r // tail
        hb = heads - tail + (r - n * tail)
    if cutlass.const_expr(pair > 1):
        n = n * pair + rank
    return n, hb % K, hb // K
