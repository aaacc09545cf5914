"""`dq_flat`'s accumulator order (DSL-free): `bwd_launch.dq_from_flat` must invert the order in
which the kernel stores a warpgroup's wgmma dQ fragment (register r = 4 c + v of thread t at
part w * part + (128 c + t) * 4 + v; r sits at row 16 (t // 32) + 8 (r // 2 % 2) + t % 32 // 4,
column 8 (r // 4) + 2 (t % 4) + r % 2 of the part). The GPU check cases confirm that this is the
hardware's fragment; this test pins the bookkeeping on both sides of it."""
import numpy as np
import pytest

from jaxflash.kernels.bwd_config import BwdConfig
from jaxflash.kernels.bwd_launch import dq_acc_shape, dq_from_flat


def _flatten_like_the_kernel(dq: np.ndarray, tile_m: int) -> np.ndarray:
    """[B, T, N, H] -> [B, N, blocks, tile_m * H] by explicit loops over threads / registers."""
    B, T, N, H = dq.shape
    nblk = -(-T // tile_m)
    pad = np.zeros((B, nblk * tile_m, N, H), dq.dtype)
    pad[:, :T] = dq
    cols = H // 2 if tile_m == 64 else H  # a warpgroup's part: head-dim half, or 64 rows
    regs = 64 * cols // 128
    out = np.zeros((B, N, nblk, tile_m * H), dq.dtype)
    for wg in range(2):
        for t in range(128):
            for r in range(regs):
                row = 16 * (t // 32) + 8 * (r // 2 % 2) + t % 32 // 4
                col = 8 * (r // 4) + 2 * (t % 4) + r % 2
                if tile_m == 64:
                    col += wg * cols
                else:
                    row += 64 * wg
                idx = wg * 64 * cols + (128 * (r // 4) + t) * 4 + r % 4
                out[:, :, :, idx] = pad[:, row::tile_m][:, :nblk, :, col].transpose(0, 2, 1)
    return out


@pytest.mark.parametrize("H,T,tile_m", [(128, 200, 64), (96, 64, 64), (256, 130, 64),
                                         (192, 1, 64), (64, 300, 128), (64, 128, 128)])
def test_dq_from_flat_inverts_the_kernels_store_order(H, T, tile_m):
    cfg = BwdConfig(head_dim=H, dq_flat=True, tile_m=tile_m)
    B, N = 2, 3
    dq = np.random.default_rng(H + T).standard_normal((B, T, N, H)).astype(np.float32)
    acc = _flatten_like_the_kernel(dq, cfg.tile_m)
    assert acc.shape == dq_acc_shape(B, T, N, H, cfg)
    np.testing.assert_array_equal(dq_from_flat(acc, T, cfg), dq)


def test_dq_flat_refusals():
    with pytest.raises(ValueError, match="dq_flat needs"):
        BwdConfig(head_dim=128, tile_m=80, dq_flat=True)
    with pytest.raises(ValueError, match="dq_flat needs"):
        BwdConfig(head_dim=128, dq_arrive=True, dq_flat=True)
    with pytest.raises(ValueError, match="dq_flat needs"):
        BwdConfig(head_dim=128, dq_accum="red", dq_flat=True)
    assert dq_acc_shape(1, 5, 2, 128, BwdConfig(head_dim=128)) == (1, 5, 2, 128)
