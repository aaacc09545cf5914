"""`dq_flat`'s accumulator order (DSL-free): `bwd_launch.dq_from_flat` must invert the order in
which the kernel stores a warpgroup's wgmma dQ fragment (register r = 4 c + v of thread t at
part w * part + (128 c + t) * 4 + v; r sits at row 16 (t // 32) + 8 (r // 2 % 2) + t % 32 // 4,
column 8 (r // 4) + 2 (t % 4) + r % 2 of the part). The GPU check cases confirm that this is the
hardware's fragment; this test pins the bookkeeping on both sides of it."""
import numpy as np
import pytest

from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.variants.bwd_launch import dq_acc_shape, dq_from_flat


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


def test_dq_acc_shape_without_dq_flat():
    assert dq_acc_shape(1, 5, 2, 128, BwdConfig(head_dim=128)) == (1, 5, 2, 128)


def test_backward_prepare_and_finish_against_numpy():
    """`kernels.call.bwd_prepare` / `bwd_finish` (the XLA halves of the CuTe backward, which
    `devtools/bwd_phases.py` also times): log2 LSE with +inf where a row saw no key or is past
    its query length or is padding, delta = rowsum(dO * O), and dQ un-permuted, scaled, cast."""
    import jax.numpy as jnp

    from jaxflash.kernels.call import bwd_finish, bwd_prepare
    rng = np.random.default_rng(3)
    B, T, N, H = 2, 70, 3, 64
    out = rng.standard_normal((B, T, N, H)).astype(np.float32)
    dout = rng.standard_normal((B, T, N, H)).astype(np.float32)
    lse = rng.standard_normal((B, N, T)).astype(np.float32)
    lse[0, 1, 5] = -np.inf
    q_seqlen = np.array([70, 33], np.int32)
    lse2, delta = bwd_prepare(jnp.asarray(lse), jnp.asarray(dout), jnp.asarray(out),
                              jnp.asarray(q_seqlen), 128)
    lse2, delta = np.asarray(lse2), np.asarray(delta)
    assert lse2.shape == delta.shape == (B, N, 128)
    want = lse * np.log2(np.e)
    want[0, 1, 5] = np.inf
    want[1, :, 33:] = np.inf
    np.testing.assert_allclose(lse2[:, :, :T], want, rtol=1e-6)
    assert np.isinf(lse2[:, :, T:]).all() and (lse2[:, :, T:] > 0).all()
    np.testing.assert_allclose(delta[:, :, :T], np.einsum("btnh,btnh->bnt", dout, out),
                               rtol=1e-5, atol=1e-5)
    assert not delta[:, :, T:].any()
    for cfg in (BwdConfig(head_dim=H, tile_m=128, dq_flat=True), BwdConfig(head_dim=H)):
        dq = rng.standard_normal((B, T, N, H)).astype(np.float32)
        acc = _flatten_like_the_kernel(dq, cfg.tile_m) if cfg.dq_flat else dq
        assert acc.shape == dq_acc_shape(B, T, N, H, cfg)
        got = np.asarray(bwd_finish(jnp.asarray(acc), T, cfg, 0.5, jnp.bfloat16)
                         .astype(jnp.float32))
        np.testing.assert_allclose(got, (dq * 0.5), rtol=1e-2, atol=1e-2)


def test_bwd_phases_probe_times_what_dispatch_runs(monkeypatch):
    """The GPU probe (`devtools/bwd_phases.py`) times the backward config dispatch picks."""
    import jax
    import jax.numpy as jnp

    from jaxflash import dispatch
    from devtools import bwd_phases
    from jaxflash.kernels.policy.choose import use_dq_flat
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    q = jax.ShapeDtypeStruct((16, 1024, 16, 128), jnp.bfloat16)
    cfg = bwd_phases._problem_config(q, q, q, False)
    assert cfg.head_dim == 128 and cfg.early_dv
    assert cfg.dq_flat == use_dq_flat(128, False, False, False, False)
