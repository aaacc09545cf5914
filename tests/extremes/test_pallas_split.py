"""The Pallas kernels index with int32 and launch a (query blocks, batch, heads) grid, so calls
whose operands pass 2^31 elements, or whose batch or head count passes the grid's 65535 y/z
limit, run as several launches over batch and kv-head slices (`pallas_fallback._pieces`). Here
the limits are lowered so small calls split (interpret mode, CPU), and the joined results must
equal the unsplit ones: outputs, LSE and every gradient, with per-batch and broadcast bias."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import pallas_fallback as pf
from jaxflash._types import AttentionArrays, AttentionStatics

pytestmark = pytest.mark.cpu


def _inputs(bias_b):
    rng = np.random.default_rng(11)
    B, T, S, N, K, H = 3, 7, 9, 4, 2, 16
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v, do = f(B, T, N, H), f(B, S, K, H), f(B, S, K, H), f(B, T, N, H)
    arrays = AttentionArrays(
        bias=f(bias_b, N, T, S),
        kv_seqlen=jnp.asarray(rng.integers(1, S + 1, B), jnp.int32),
        alibi_slopes=jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32),
        q_segment_ids=jnp.asarray(rng.integers(0, 2, (B, T)), jnp.int32),
        kv_segment_ids=jnp.asarray(rng.integers(0, 2, (B, S)), jnp.int32))
    return q, k, v, do, arrays, AttentionStatics(scale=H ** -0.5, is_causal=True)


def _run(q, k, v, do, arrays, statics):
    out, lse = pf.forward(q, k, v, arrays, statics, interpret=True)
    grads = pf.backward(q, k, v, arrays, statics, out, lse, do, interpret=True)
    return (out, lse) + tuple(grads)


@pytest.mark.parametrize("bias_b", [1, 3])
def test_split_equals_whole(monkeypatch, bias_b):
    q, k, v, do, arrays, statics = _inputs(bias_b)
    run = jax.jit(_run, static_argnums=5)
    whole = run(q, k, v, do, arrays, statics)
    # One kv head (with its 2 query heads) of one batch element per launch.
    monkeypatch.setattr(pf, "_INT32_MAX", 2 * 7 * 16 + 1)
    assert len(pf._pieces(q, k, v, arrays)) == 6
    split = jax.jit(_run, static_argnums=5)(q, k, v, do, arrays, statics)
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dalibi")
    for name, a, b in zip(names, whole, split):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6,
                                   err_msg=name)


def test_batch_pieces_when_heads_fit(monkeypatch):
    q, k, v, _, arrays, _ = _inputs(1)
    monkeypatch.setattr(pf, "_GRID_YZ_MAX", 2)  # batch 3 -> 2 + 1; heads G=2 -> one kv head
    assert pf._pieces(q, k, v, arrays) == [(0, 1, 0, 1), (0, 1, 1, 2), (1, 2, 0, 1),
                                            (1, 2, 1, 2), (2, 3, 0, 1), (2, 3, 1, 2)]


def test_cute_forward_whose_backward_nobody_serves():
    """A CuTe forward whose backward neither the CuTe kernel nor the Pallas kernels serve
    (ALiBi at 2.2M tokens, one kv head: a kv head's slice past int32 indexing) still runs,
    and `explain` says there is no backward; differentiating it raises with both reasons
    (lowered for CUDA, no GPU needed)."""
    pytest.importorskip("cutlass", reason="planning the CuTe kernels needs the DSL")
    import jaxflash
    S = 2228224
    q = jax.ShapeDtypeStruct((1, S, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, S, 1, 128), jnp.bfloat16)
    sl = jax.ShapeDtypeStruct((8,), jnp.float32)
    f = lambda q, k, v, s: jnp.sum(jaxflash.flash_attention(
        q, k, v, is_causal=True, alibi_slopes=s).astype(jnp.float32))
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, k, k, is_causal=True, alibi_slopes=sl)
        assert plan.backend == "cute" and "backward: none" in str(plan), str(plan)
        jax.jit(f).trace(q, k, k, sl).lower(lowering_platforms=("cuda",))
        with pytest.raises(NotImplementedError, match="int32"):
            jax.jit(jax.grad(f)).trace(q, k, k, sl).lower(lowering_platforms=("cuda",))
