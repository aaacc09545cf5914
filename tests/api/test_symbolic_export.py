"""`jax.export` with symbolic batch and sequence dims (shape polymorphism): the XLA reference
serves such calls, every feature and the gradients included; the kernel backends refuse by
name (they are picked and compiled per shape), so dispatch falls back visibly. The exported
artifact, serialized and loaded again, gives the jitted function's results on concrete
shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxflash
from jaxflash import mods
from tests.common import fresh_rng

B, T, N, K, H = 3, 37, 4, 2, 32


def _inputs(rng):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T))), jnp.int32)
    lens = jnp.asarray(rng.integers(1, T + 1, (B,)), jnp.int32)
    bias = jnp.asarray(rng.standard_normal((B, N, T, T)), jnp.float32)
    return q, k, seg, lens, bias


CASES = {
    "causal-window-softcap-alibi": lambda q, k, seg, lens, bias: jaxflash.flash_attention(
        q, k, k, is_causal=True, local_window_size=(5, 0), softcap=4.0,
        alibi_slopes=jnp.linspace(0.1, 0.4, N)),
    "segments-lengths": lambda q, k, seg, lens, bias: jaxflash.flash_attention(
        q, k, k, q_segment_ids=seg, kv_segment_ids=seg, query_seq_lengths=lens,
        key_value_seq_lengths=lens),
    "bias-mask": lambda q, k, seg, lens, bias: jaxflash.flash_attention(
        q, k, k, bias=bias, mask=bias > -1.0),
    "mods": lambda q, k, seg, lens, bias: jaxflash.flash_attention(
        q, k, k, score_mod=mods.alibi(0), mask_mod=mods.and_masks(mods.causal(),
                                                                  mods.document(1)),
        aux=(jnp.linspace(0.1, 0.4, N), seg)),
    "grads": lambda q, k, seg, lens, bias: jax.grad(
        lambda q, k, a: jnp.sum(jnp.sin(jaxflash.flash_attention(
            q, k, k, is_causal=True, score_mod=mods.alibi(0), aux=(a,)))),
        argnums=(0, 1, 2))(q, k, jnp.linspace(0.1, 0.4, N)),
    "residual-fp8-emulated": lambda q, k, seg, lens, bias: jaxflash.flash_attention(
        q, k, k, precision="fp8", emulate=True, return_residual=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_symbolic_batch_and_length(name):
    fn = CASES[name]
    b, t = export.symbolic_shape("b, t")
    specs = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((b, t, N, H), jnp.float32), ((b, t, K, H), jnp.float32), ((b, t), jnp.int32),
        ((b,), jnp.int32), ((b, N, t, t), jnp.float32))]
    exp = export.export(jax.jit(fn), platforms=["cpu"])(*specs)
    assert "b" in str(exp.in_avals[0]) and "t" in str(exp.in_avals[0])
    loaded = export.deserialize(exp.serialize())
    args = _inputs(fresh_rng())
    got, want = loaded.call(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_fp8_with_a_symbolic_batch():
    """FP8 operands with head scales, and precision="fp8" at a length whose scale blocks tile
    it (the Triton prologue's shape checks must not decide on a symbolic batch), export with a
    symbolic batch and give the jitted results."""
    b, = export.symbolic_shape("b")
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((B, 128, N, H)), jnp.float32)
    from jaxflash import quantize as Q
    x8, xs = Q.quantize(x, granularity="head")
    fp8 = lambda x8, xs: jaxflash.flash_attention(x8, x8, x8, q_scale=xs, k_scale=xs,
                                                  v_scale=xs, is_causal=True)
    rec = lambda x: jaxflash.flash_attention(x, x, x, precision="fp8", is_causal=True)
    for fn, args, specs in (
            (fp8, (x8, xs), (jax.ShapeDtypeStruct((b, 128, N, H), x8.dtype),
                             jax.ShapeDtypeStruct((b, N), xs.dtype))),
            (rec, (x.astype(jnp.bfloat16),), (jax.ShapeDtypeStruct((b, 128, N, H),
                                                                   jnp.bfloat16),))):
        exp = export.export(jax.jit(fn), platforms=["cpu"])(*specs)
        got, want = export.deserialize(exp.serialize()).call(*args), jax.jit(fn)(*args)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_kernels_refuse_symbolic_shapes_by_name():
    b, t = export.symbolic_shape("b, t")
    s = jax.ShapeDtypeStruct((b, t, N, 64), jnp.bfloat16)
    with jaxflash.target_platform("cuda"):
        text = str(jaxflash.explain(s, s, s, is_causal=True))
    assert "'xla' runs" in text
    for name in ("cute", "cudnn", "pallas"):
        assert f"'{name}' refused: symbolic batch, q_len, kv_len (jax.export" in text, text
    n, = export.symbolic_shape("n")
    with pytest.raises(NotImplementedError, match="symbolic head counts or head dims"):
        export.export(jax.jit(lambda q: jaxflash.flash_attention(q, q, q)), platforms=["cpu"])(
            jax.ShapeDtypeStruct((2, 8, n, 16), jnp.float32))
    f8 = jax.ShapeDtypeStruct((b, t, N, 32), jnp.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="FP8 inputs with symbolic sequence lengths"):
        export.export(jax.jit(lambda q: jaxflash.flash_attention(q, q, q, q_scale=1.0,
                                                                 k_scale=1.0, v_scale=1.0)),
                      platforms=["cpu"])(f8)
    with pytest.raises(NotImplementedError, match="symbolic batch"):
        export.export(jax.jit(lambda q: jaxflash.flash_attention(q, q, q,
                                                                 implementation="pallas")),
                      platforms=["cpu"])(jax.ShapeDtypeStruct((b, 16, N, 32), jnp.float32))


def test_flax_layer_exports_with_a_symbolic_batch():
    from jaxflash.flax_layers import LinenFlashMultiHeadAttention
    m = LinenFlashMultiHeadAttention(num_heads=N, num_kv_heads=K, qkv_features=64,
                                     is_causal=True, rope=True)
    x = jnp.asarray(fresh_rng().standard_normal((2, 19, 32)), jnp.float32)
    params = m.init(jax.random.key(0), x)
    f = jax.jit(lambda p, x: m.apply(p, x))
    b, t = export.symbolic_shape("b, t")
    exp = export.export(f, platforms=["cpu"])(params, jax.ShapeDtypeStruct((b, t, 32),
                                                                           jnp.float32))
    np.testing.assert_allclose(np.asarray(exp.call(params, x)), np.asarray(f(params, x)),
                               rtol=1e-5, atol=1e-5)
