"""`jaxflash.kernels.variants.keys_major`'s Triton kernel compiled on a CUDA GPU: the same
bytes as XLA's transpose (the check `keys_major.IMPL` waits on)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.kernels.variants import keys_major as KM
from jaxflash.kernels.variants.bwd_fp8_launch import K_SPLIT, Q_SPLIT
from jaxflash.kernels.variants.fwd_fp8_launch import V_SPLIT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("split", [Q_SPLIT, K_SPLIT, V_SPLIT], ids=["q", "k", "v"])
@pytest.mark.parametrize("shape", [(2, 1024, 8, 64), (1, 2048, 4, 128), (2, 512, 3, 256)])
def test_triton_keys_major_on_gpu(split, shape):
    u = np.random.default_rng(shape[-1]).integers(0, 256, shape).astype(np.uint8)
    x8 = jax.lax.bitcast_convert_type(jnp.asarray(u), jnp.float8_e4m3fn)
    want = jax.jit(KM._xla, static_argnums=(1, 2))(x8, split, shape[1])
    got = KM._triton(x8, split)
    b = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
    np.testing.assert_array_equal(b(got), b(want))
