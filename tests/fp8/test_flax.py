"""FP8 through the Flax integration: ``attention_precision="fp8"`` on `FlashMultiHeadAttention`
(NNX and Linen) and on `attention_fn` in Flax's own MultiHeadAttention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
from flax import linen  # noqa: E402

from jaxflash import flax_layers as FL  # noqa: E402


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_layers_and_attention_fn_take_fp8():
    B, T, F, N = 2, 64, 128, 2                    # head dim 64
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, F)), jnp.float32)
    mk = lambda prec: FL.FlashMultiHeadAttention(N, F, num_kv_heads=1, is_causal=True,
                                                 attention_precision=prec, rngs=nnx.Rngs(0))
    flax_mha = lambda fn: nnx.MultiHeadAttention(N, F, decode=False, attention_fn=fn,
                                                 rngs=nnx.Rngs(1))
    lin = lambda prec: FL.LinenFlashMultiHeadAttention(N, attention_precision=prec,
                                                       is_causal=True)
    lp = lin(None).init(jax.random.key(2), x)
    fp8_fn = FL.make_attention_fn(attention_precision="fp8")
    m8, m, a8, a = mk("fp8"), mk(None), flax_mha(fp8_fn), flax_mha(FL.attention_fn)

    @jax.jit
    def run(x):
        def grad_of(layer):
            return jax.grad(lambda x: jnp.sum(layer(x) ** 2))(x)
        return (m8(x), m(x), grad_of(m8), grad_of(m), a8(x), a(x), lin("fp8").apply(lp, x),
                lin(None).apply(lp, x))

    y8, y, g8, g, z8, z, l8, l = run(x)
    assert _rel(y8, y) < 0.08 and _rel(g8, g) < 0.12
    assert _rel(z8, z) < 0.08 and _rel(l8, l) < 0.08
    assert not np.array_equal(np.asarray(y8), np.asarray(y))   # FP8 did run
    assert FL.last_fallback_reason is None
    with pytest.raises(ValueError, match="attention_precision"):
        mk("fp16")
    with pytest.raises(ValueError, match="attention_precision"):
        FL.attention_fn(x[:, :, None, :64], x[:, :, None, :64], x[:, :, None, :64],
                        attention_precision="int8")


def test_example_lm_flag_reaches_the_layers():
    from examples.lm import train
    from examples.lm.model import LM
    cfg = train.config_from_args(train.parse_args(["--size", "tiny",
                                                   "--attention-precision", "fp8"]))
    assert cfg.attention_precision == "fp8"
    with jax.set_mesh(train.make_mesh("1,1")):    # the model's parameters carry mesh axes
        model = nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0)))   # shapes only: no compute
    assert all(b.attn.opts.attention_precision == "fp8" for b in model.blocks)
    base = train.config_from_args(train.parse_args(["--size", "tiny"]))
    assert base.attention_precision is None
