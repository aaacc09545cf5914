"""A plain-Python model of the persistent forward's tile order (`scheduler.TileScheduler`), for
tests and for choosing orders without a GPU: which tiles each CTA takes and how much key-block
work that is. It mirrors `tile_of_round` / `decode` / `num_slots` line for line (the kernel's
versions are DSL code and run only on the device; the GPU check cases confirm those cover every
tile once).

    python3 -m devtools.sched_model      # busiest CTA / mean work on the anchor grid

The backward's launch order (`bwd_order.block_coords`) is modelled the same way, with the
hardware's in-order start of CTAs on the first free SM.
"""
from __future__ import annotations

from jaxflash.kernels.variants.fwd import L2_SECTION_MB, FwdConfig
from jaxflash.kernels.common.scheduler import NUM_SMS


def tile_of_round(r: int, cta: int, grid: int, lpt: bool, pairs: bool) -> int:
    t = r * grid + cta
    if pairs:
        q = r // 2
        k = grid - 1 - cta if q % 2 == 1 else cta
        return (q * grid + k) * 2 + r % 2
    if lpt and r % 2 == 1:
        t = r * grid + (grid - 1 - cta)
    return t


def decode(tile: int, nm: int, heads: int, batch: int, kv_bytes_per_head: int, lpt: bool,
           pairs: bool, section_bytes: int) -> tuple[int, int, int]:
    if pairs:
        per_head = (nm + 1) // 2
        unit = tile // 2
        hb = unit // per_head
        p = unit - hb * per_head
        m = nm - 1 - p
        if tile % 2 == 1:
            m = -1 if p == nm - 1 - p else p
    elif not lpt:
        m, hb = tile % nm, tile // nm
    else:
        total = heads * batch
        section = min(max(section_bytes // max(kv_bytes_per_head, 1), 1), total)
        per_section = section * nm
        sec, rem = divmod(tile, per_section)
        first = sec * section
        width = min(section, total - first)
        m, hb = nm - 1 - rem // width, first + rem % width
    return m, hb % heads, hb // heads


def cta_tiles(cfg: FwdConfig, T: int, S: int, heads: int, batch: int, kv_heads=None,
              grid: int = NUM_SMS) -> list[list[tuple[int, int, int]]]:
    """The (m_block, head, batch) tiles each CTA of a persistent launch computes, in order."""
    nm = -(-T // cfg.tile_m)
    pairs = cfg.tile_order == "pairs"
    slots = (nm + 1) // 2 * 2 * heads * batch if pairs else nm * heads * batch
    kv_bytes = S * (cfg.head_dim + cfg.head_dim_v) * 2
    grid = min(grid, nm * heads * batch)
    out = []
    for cta in range(grid):
        tiles, r = [], 0
        while (t := tile_of_round(r, cta, grid, cfg.lpt, pairs)) < slots:
            m, h, b = decode(t, nm, heads, batch, kv_bytes, cfg.lpt, pairs,
                             L2_SECTION_MB * 1024 * 1024)
            if m >= 0:
                tiles.append((m, h, b))
            r += 1
        out.append(tiles)
    return out


def causal_blocks(cfg: FwdConfig, m: int, T: int, S: int) -> int:
    """Key blocks a causal (top-left aligned) tile m visits."""
    last_row = min((m + 1) * cfg.tile_m, T) - 1
    return min(last_row // cfg.tile_n + 1, -(-S // cfg.tile_n))


def balance(cfg: FwdConfig, T: int, S: int, heads: int, batch: int,
            per_tile: float = 0.5) -> float:
    """Busiest CTA's work / the mean (1.0 = perfect), work = causal key blocks + `per_tile`
    blocks' worth of fixed cost per tile (prologue / epilogue)."""
    loads = [sum(causal_blocks(cfg, m, T, S) + per_tile for m, _, _ in tiles)
             for tiles in cta_tiles(cfg, T, S, heads, batch)]
    return max(loads) / (sum(loads) / len(loads))


def bwd_block_coords(linear: int, nn: int, K: int, B: int, T: int, row_bytes: int,
                     tail_lpt: bool, pair: int = 1) -> tuple[int, int, int]:
    """`bwd_order.block_coords` (or the plain x / y / z order): the (n_block, kv_head, batch)
    of the backward CTA launched `linear`-th (x fastest; ``pair``: CTAs per cluster along x,
    nn a multiple of it)."""
    from jaxflash.kernels.sm90.bwd_order import TAIL_L2_BYTES
    rank = 0
    if pair > 1:
        x, yz = linear % nn, linear // nn
        rank, nn = x % pair, nn // pair
        linear = x // pair + nn * yz
    heads = K * B
    hb, n = divmod(linear, nn)
    if tail_lpt:
        tail = min(max(TAIL_L2_BYTES // max(T * row_bytes, 1), 1), heads)
        start = (heads - tail) * nn
        if linear >= start:
            n, rest = divmod(linear - start, tail)
            hb = heads - tail + rest
    return n * pair + rank, hb % K, hb // K


def bwd_balance(D: int, S: int, tile_m: int, tile_n: int, tail_lpt: bool,
                per_cta: float = 2.0, sms: int = NUM_SMS) -> float:
    """Busiest SM / mean work of the causal backward's grid (T = S, B = 16384 / S, H = 2048 /
    D): CTAs start in launch order on the first free SM (one per SM), CTA n costs its query
    blocks (from the diagonal on) + `per_cta` steps of fixed cost."""
    import heapq
    B, K = 16384 // S, 2048 // D
    nn, nm = -(-S // tile_n), -(-S // tile_m)
    free = [(0.0, i) for i in range(sms)]
    total = 0.0
    for linear in range(nn * K * B):
        n, _, _ = bwd_block_coords(linear, nn, K, B, S, D * 8, tail_lpt)
        w = nm - n * tile_n // tile_m + per_cta
        t, i = heapq.heappop(free)
        heapq.heappush(free, (t + w, i))
        total += w
    return max(t for t, _ in free) / (total / sms)


def main():
    for D, tile_m in ((64, 192), (128, 128), (256, 128)):
        for S in (1024, 4096, 16384):
            row = []
            for order in ("auto", "pairs"):
                cfg = FwdConfig(head_dim=D, tile_m=tile_m, is_causal=True, persistent=True,
                                tile_pipe=True, tile_order=order)
                row.append(balance(cfg, S, S, 2048 // D, 16384 // S))
            print(f"D={D} S={S} causal: busiest CTA / mean  lpt {row[0]:.3f}  pairs {row[1]:.3f}")
    for D, tile_m, tile_n in ((64, 128, 128), (128, 64, 128), (256, 64, 64)):
        for S in (1024, 4096, 16384):
            plain, tail = (bwd_balance(D, S, tile_m, tile_n, t) for t in (False, True))
            print(f"backward D={D} S={S} causal: busiest SM / mean  launch order {plain:.3f}  "
                  f"tail_lpt {tail:.3f}")


if __name__ == "__main__":
    main()
