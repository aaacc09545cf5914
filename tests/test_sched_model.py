"""The persistent forward's tile orders (`devtools/sched_model.py`, the plain-Python mirror of
`scheduler.TileScheduler`): every tile exactly once, and the balance that motivates "pairs"."""
import collections

import pytest

pytest.importorskip("cutlass", reason="the model reads the scheduler's constants (CuTe DSL)")

from devtools.sched_model import balance, cta_tiles  # noqa: E402
from jaxflash.kernels.variants.fwd import FwdConfig  # noqa: E402


@pytest.mark.parametrize("order", ["auto", "pairs"])
@pytest.mark.parametrize("T,heads,batch,tile_m", [(1024, 16, 16, 128), (640, 12, 3, 128),
                                                   (999, 7, 2, 128), (100, 3, 1, 128),
                                                   (1000, 8, 8, 192), (4096, 2, 1, 128)])
def test_every_tile_once(order, T, heads, batch, tile_m):
    cfg = FwdConfig(head_dim=64 if tile_m == 192 else 128, tile_m=tile_m, is_causal=True,
                    persistent=True, tile_pipe=True, tile_order=order)
    nm = -(-T // tile_m)
    seen = collections.Counter(t for tiles in cta_tiles(cfg, T, T, heads, batch)
                               for t in tiles)
    want = {(m, h, b) for m in range(nm) for h in range(heads) for b in range(batch)}
    assert set(seen) == want and max(seen.values()) == 1


def test_pairs_take_both_ends_of_a_head():
    cfg = FwdConfig(head_dim=128, is_causal=True, persistent=True, tile_pipe=True,
                    tile_order="pairs")
    tiles = cta_tiles(cfg, 1024, 1024, 16, 16)[5]
    for (m0, h0, b0), (m1, h1, b1) in zip(tiles[::2], tiles[1::2]):
        assert (h0, b0) == (h1, b1) and m0 + m1 == 7 and m0 > m1  # the long tile first


def test_pairs_balance_the_causal_grid_where_lpt_does_not():
    """The model's busiest-CTA / mean work at D=128 causal: LPT dealt round-robin to 132
    persistent CTAs ~1.19-1.21x, pairs ~1.03x."""
    for S in (1024, 4096):
        lpt, pairs = (balance(FwdConfig(head_dim=128, is_causal=True, persistent=True,
                                        tile_pipe=True, tile_order=o), S, S, 16, 16384 // S)
                      for o in ("auto", "pairs"))
        assert lpt > 1.15 and pairs < 1.05


def test_pairs_needs_the_tile_pipe_and_a_mask():
    with pytest.raises(ValueError, match="pairs"):
        FwdConfig(head_dim=128, is_causal=True, persistent=True, tile_order="pairs")
    with pytest.raises(ValueError, match="pairs"):
        FwdConfig(head_dim=128, persistent=True, tile_pipe=True, tile_order="pairs")
    with pytest.raises(ValueError, match="tile_order"):  # the plain / LPT orders follow the mask
        FwdConfig(head_dim=128, is_causal=True, tile_order="lpt")
    cfg = FwdConfig(head_dim=128, is_causal=True, persistent=True, tile_pipe=True,
                    tile_order="pairs")
    assert "_pairs" in cfg.key and not cfg.lpt
    assert "_pairs" not in FwdConfig(head_dim=128, is_causal=True).key


@pytest.mark.parametrize("nn,K,B,T", [(8, 16, 16, 1024), (32, 16, 4, 4096), (3, 5, 2, 300),
                                      (128, 16, 1, 16384), (1, 1, 1, 64)])
def test_backward_tail_order_launches_every_block_once(nn, K, B, T):
    from devtools.sched_model import bwd_block_coords
    got = [bwd_block_coords(i, nn, K, B, T, 128 * 8, True) for i in range(nn * K * B)]
    assert sorted(got) == sorted((n, k, b) for n in range(nn) for k in range(K)
                                 for b in range(B))
    # lower key blocks of a head always launch first (deterministic mode waits on them)
    first = {}
    for i, (n, k, b) in enumerate(got):
        first[(n, k, b)] = i
    assert all(first[(n - 1, k, b)] < first[(n, k, b)] for (n, k, b) in first if n > 0)


@pytest.mark.parametrize("nn,K,B,T", [(8, 16, 16, 1024), (64, 8, 4, 4096), (2, 3, 2, 100)])
def test_backward_tail_order_keeps_clusters_on_adjacent_blocks(nn, K, B, T):
    """q_multicast's clusters (x = 2j, 2j + 1) get key blocks 2j', 2j' + 1 of one head, and
    every block is launched once."""
    from devtools.sched_model import bwd_block_coords
    got = [bwd_block_coords(i, nn, K, B, T, 256 * 8, True, pair=2) for i in range(nn * K * B)]
    assert sorted(got) == sorted((n, k, b) for n in range(nn) for k in range(K)
                                 for b in range(B))
    for i in range(0, len(got), 2):
        (n0, k0, b0), (n1, k1, b1) = got[i], got[i + 1]
        assert n0 % 2 == 0 and n1 == n0 + 1 and (k0, b0) == (k1, b1), (i, got[i], got[i + 1])


def test_backward_tail_order_balances_causal():
    from devtools.sched_model import bwd_balance
    for D, tile_m, tile_n in ((128, 64, 128), (256, 64, 64)):
        plain, tail = (bwd_balance(D, 1024, tile_m, tile_n, t) for t in (False, True))
        assert plain > 1.05 and tail < 1.03
