"""The CuTe backward splits batches and kv-head counts past the launch grid's 65535 y/z limit
into several launches (`jaxflash.kernels.call.backward`). The split is checked on CPU with the
limit lowered and the launch replaced by the reference's gradients: the joined result must equal
the unsplit one exactly, for every per-batch and per-head operand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import reference
from jaxflash._types import AttentionArrays, AttentionStatics
from jaxflash.kernels import call

pytestmark = pytest.mark.cpu


def _fake_backward(launch, q, k, v, arrays, statics, out, lse, dout):
    def f(q, k, v, slopes):
        return reference.attention(q, k, v, arrays._replace(alibi_slopes=slopes), statics)[0]
    _, vjp = jax.vjp(f, q, k, v, arrays.alibi_slopes)
    dq, dk, dv, ds = vjp(dout)
    return dq, dk, dv, None, ds


@pytest.mark.parametrize("limit", [2, 3])
def test_split_equals_whole(monkeypatch, limit):
    rng = np.random.default_rng(7)
    B, T, S, N, K, H = 5, 9, 11, 8, 4, 16
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                   ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    arrays = AttentionArrays(
        q_seqlen=jnp.asarray(rng.integers(1, T + 1, B), jnp.int32),
        kv_seqlen=jnp.asarray(rng.integers(1, S + 1, B), jnp.int32),
        alibi_slopes=jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32),
        q_segment_ids=jnp.asarray(rng.integers(0, 2, (B, T)), jnp.int32),
        kv_segment_ids=jnp.asarray(rng.integers(0, 2, (B, S)), jnp.int32))
    statics = AttentionStatics(scale=H ** -0.5, is_causal=True)
    monkeypatch.setattr(call, "_backward", _fake_backward)
    whole = _fake_backward(None, q, k, v, arrays, statics, None, None, do)
    monkeypatch.setattr(call, "GRID_YZ_MAX", limit)
    split = call.backward(None, q, k, v, arrays, statics, jnp.zeros_like(do),
                          jnp.zeros((B, N, T)), do)
    for name, a, b in zip(("dq", "dk", "dv"), whole[:3], split[:3]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(np.asarray(split[4]), np.asarray(whole[4]), rtol=1e-4,
                               atol=1e-5)
