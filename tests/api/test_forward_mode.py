"""Forward-mode autodiff (jvp, jacfwd, Hessians) through the XLA reference, as through
jax.nn.dot_product_attention: JAX differentiates its plain passes itself (under
jax.checkpoint), with mods and their aux leaves too. Kernel backends pair a forward kernel
with a backward one (a custom_vjp), which forward mode cannot enter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mods
from tests.common import fresh_rng


def _inputs():
    rng = fresh_rng()
    q = jnp.asarray(rng.standard_normal((2, 9, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 11, 2, 8)), jnp.float32)
    t = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    return q, k, t


def _jaxnn(q, k, **kw):
    kk = jnp.repeat(k, 2, axis=2)
    return jax.nn.dot_product_attention(q, kk, kk, **kw)


def test_jvp_jacfwd_and_hessian_match_jax_nn():
    q, k, t = _inputs()
    ours = lambda q: jaxflash.flash_attention(q, k, k, is_causal=True)   # CPU: xla
    ref = lambda q: _jaxnn(q, k, is_causal=True)
    jvp = lambda f: jax.jit(lambda q, t: jax.jvp(f, (q,), (t,))[1])(q, t)
    np.testing.assert_allclose(jvp(ours), jvp(ref), atol=2e-5)
    part = lambda f: (lambda x: f(q.at[1, 4, 0].set(x)))   # jacfwd over one query row
    np.testing.assert_allclose(jax.jit(jax.jacfwd(part(ours)))(q[1, 4, 0]),
                               jax.jit(jax.jacfwd(part(ref)))(q[1, 4, 0]), atol=2e-5)
    sub = lambda f: (lambda x: jnp.sum(jnp.sin(f(q.at[0, :2, 0, :3].set(x)))))
    h = jax.jit(jax.hessian(sub(ours)))(q[0, :2, 0, :3])
    assert np.all(np.isfinite(h))
    np.testing.assert_allclose(h, jax.jit(jax.hessian(sub(ref)))(q[0, :2, 0, :3]), atol=2e-5)


def test_jvp_through_a_score_mod_and_its_aux():
    q, k, _ = _inputs()
    slopes = jnp.linspace(0.1, 0.5, 4)
    ours = lambda a: jaxflash.flash_attention(q, k, k, score_mod=mods.alibi(0), aux=(a,),
                                              implementation="xla")
    ref = lambda a: jaxflash.flash_attention(q, k, k, alibi_slopes=a, implementation="xla")
    d = jnp.asarray([1.0, -0.5, 0.25, 2.0])
    np.testing.assert_allclose(jax.jvp(ours, (slopes,), (d,))[1],
                               jax.jvp(ref, (slopes,), (d,))[1], atol=2e-5)


def test_kernel_backends_refuse_forward_mode():
    q, k, t = _inputs()
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: jaxflash.flash_attention(q, k, k, implementation="pallas"), (q,), (t,))
