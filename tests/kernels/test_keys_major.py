"""`jaxflash.kernels.variants.keys_major`: the Triton kernel (Pallas' interpret mode here)
moves the bytes exactly as the XLA transpose does, for the forward's V^T and the backward's
Q^T / K^T / dO^T orders; and the pick falls back to XLA where the kernel cannot run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.kernels.variants import keys_major as KM
from jaxflash.kernels.variants.bwd_fp8_launch import K_SPLIT, Q_SPLIT
from jaxflash.kernels.variants.fwd_fp8_launch import V_SPLIT


def _bytes(x):
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


@pytest.mark.parametrize("split", [Q_SPLIT, K_SPLIT, V_SPLIT], ids=["q", "k", "v"])
@pytest.mark.parametrize("shape", [(2, 256, 3, 64), (1, 128, 2, 256), (1, 384, 1, 16)])
def test_triton_moves_the_same_bytes(split, shape):
    u = np.random.default_rng(shape[-1]).integers(0, 256, shape).astype(np.uint8)
    x8 = jax.lax.bitcast_convert_type(jnp.asarray(u), jnp.float8_e4m3fn)
    want = KM._xla(x8, split, shape[1])
    got = KM._triton(x8, split, interpret=True)
    assert got.dtype == x8.dtype and got.shape == want.shape == (shape[0], shape[2], shape[3],
                                                                  shape[1])
    np.testing.assert_array_equal(_bytes(got), _bytes(want))


def test_pick(monkeypatch):
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float8_e4m3fn)
    assert KM.pick(x, 256, "cuda") == KM.IMPL == "triton"
    assert KM.pick(x, 256, "gpu", "triton") == "triton"
    assert KM.pick(x, 256, "cpu", "triton") == "xla"
    assert KM.pick(x, 384, "gpu", "triton") == "xla"        # padding: XLA's
    assert KM.pick(jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.float8_e4m3fn), 200, "gpu",
                   "triton") == "xla"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    assert KM.pick(x, 256, "gpu", "triton") == "xla"
    with pytest.raises(ValueError, match="keys-major"):
        KM.pick(x, 256, "gpu", "fast")


def test_triton_lowers_and_exports_for_cuda():
    """The kernel's Triton lowering, emitted without a GPU: one custom call, exportable with
    jaxflash's safety checks."""
    from jaxflash import ffi, target_platform
    x = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.float8_e4m3fn)
    f = jax.jit(lambda x: KM._triton(x, Q_SPLIT))
    with target_platform("cuda"):
        txt = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        exp = jax.export.export(f, platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(x)
    assert txt.count("__gpu$xla.gpu.triton") == 1
    back = jax.export.deserialize(exp.serialize())
    assert [o.shape for o in back.out_avals] == [(2, 4, 128, 256)]
