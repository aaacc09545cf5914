"""Edges of a mod's translation into kernel programs (`kernels.variants.mod_program`): the
rounding method of a round, integer intervals through clamp, user derivative rules, constant
factors the softmax cannot take, signed zeros, saturating conversions, and objects a mod's
closure reads. Each once made a program differ from the mod it came from, on every backend
where a mask is recognized as a built-in from its program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxflash
from jaxflash.kernels import mod_blocks
from jaxflash.kernels.variants import mod_program as mp
from jaxflash.mods import make_spec, score_deriv_jaxpr
from tests.common import fresh_rng


def _qkv(T=24, N=2, D=16):
    r = fresh_rng()
    return tuple(jnp.asarray(r.standard_normal((1, T, N, D)), jnp.float32) for _ in range(3))


def _reference(q, k, v, mask=None, score=None):
    """Dense float32 attention with the mod evaluated by jnp on the index grid."""
    T, S = q.shape[1], k.shape[1]
    grid = lambda f: jax.vmap(lambda i: jax.vmap(lambda j: f(i, j))(jnp.arange(S)))(
        jnp.arange(T))
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(q.shape[-1])
    if score is not None:
        s = jax.vmap(lambda x: jax.vmap(lambda i: jax.vmap(lambda j: score(
            x[i, j], 0, 0, i, j))(jnp.arange(S)))(jnp.arange(T)))(
                s.reshape(-1, T, S)).reshape(s.shape)
    if mask is not None:
        s = jnp.where(grid(lambda i, j: mask(0, 0, i, j)), s, -jnp.inf)
    return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, -1), v)


def _eval(fn, kind, **scalars):
    spec, _ = make_spec(**{f"{kind}_mod": fn})
    text = mp.spec_texts(spec)[kind]
    return mp.evaluate(mp.parse(text), scalars)[0]


def test_round_keeps_its_rounding_method():
    """jnp.round rounds half to even, lax.round's default half away from zero: two programs,
    each evaluated as jnp does, on ties and on values where x + 0.5 rounds in float32."""
    even = lambda s, b, h, q, k: jnp.round(s)
    away = lambda s, b, h, q, k: lax.round(s, lax.RoundingMethod.AWAY_FROM_ZERO)
    texts = [mp.spec_texts(make_spec(score_mod=f)[0])["score"] for f in (even, away)]
    assert texts[0] != texts[1]
    xs = np.float32([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 8388609.0, 3.7, -3.2])
    for f in (even, away):
        prog = mp.parse(mp.spec_texts(make_spec(score_mod=f)[0])["score"])
        got = [mp.evaluate(prog, dict(s=x, b=0, h=0, q=0, k=0))[0] for x in xs]
        want = np.asarray(jax.vmap(lambda x: f(x, 0, 0, 0, 0))(jnp.asarray(xs)))
        np.testing.assert_array_equal(np.float32(got), want)
        xla, = mod_blocks.evaluate(prog, dict(s=jnp.asarray(xs), b=0, h=0, q=0, k=0))
        np.testing.assert_array_equal(np.asarray(xla), want)


def test_round_mask_is_not_taken_for_another_builtin():
    """round((k - q) / 2) <= 0 keeps k <= q + 1 (half to even): run as what it is."""
    mask = lambda b, h, q, k: jnp.round((k - q) * 0.5) <= 0
    q, k, v = _qkv()
    out = jaxflash.flash_attention(q, k, v, mask_mod=mask, implementation="xla")
    np.testing.assert_allclose(out, _reference(q, k, v, mask=mask), atol=2e-5)


def test_clamp_interval_does_not_fold_a_live_compare():
    """clamp(0, min(|k - q|, 64) + 1, k) > 0 is k > 0: not always true."""
    mask = lambda b, h, q, k: lax.clamp(0, jnp.minimum(jnp.abs(k - q), 64) + 1, k) > 0
    text = mp.spec_texts(make_spec(mask_mod=mask)[0])["mask"]
    assert "out True" not in text
    q, k, v = _qkv()
    out = jaxflash.flash_attention(q, k, v, mask_mod=mask, implementation="xla")
    ref = _reference(q, k, v, mask=mask)
    ok = ~jnp.isnan(ref)   # row 0 sees no key
    np.testing.assert_allclose(out[ok], ref[ok], atol=2e-5)


@jax.custom_jvp
def _ste_floor(x):
    return jnp.floor(x)


_ste_floor.defjvps(lambda g, ans, x: g)


def test_custom_jvp_rule_reaches_the_kernel_derivative():
    """A straight-through floor differentiates as its rule says (1), a plain floor as 0: two
    backward programs, each with jax.jvp's derivative."""
    ste = lambda s, b, h, q, k: _ste_floor(s * 4.0) / 4.0
    plain = lambda s, b, h, q, k: jnp.floor(s * 4.0) / 4.0
    grads = {}
    for name, f in (("ste", ste), ("plain", plain), ("relu", lambda s, *_: jax.nn.relu(s))):
        spec, _ = make_spec(score_mod=f)
        text = mp.spec_texts(spec)["score_grad"]
        for x in (0.0, 0.3, -0.7):
            got = mp.evaluate(mp.parse(text), dict(s=np.float32(x), b=0, h=0, q=0, k=0))[1]
            want = jax.core.eval_jaxpr(score_deriv_jaxpr(spec).jaxpr, score_deriv_jaxpr(spec).consts,
                                       jnp.float32(x), 0, 0, 0, 0)[1]
            assert float(got) == float(want), (name, x)
        grads[name] = text
    assert grads["ste"] != grads["plain"]


def test_custom_vjp_score_mod_is_refused_by_name():
    @jax.custom_vjp
    def f(x):
        return x * 2.0
    f.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 3.0,))
    spec, _ = make_spec(score_mod=lambda s, b, h, q, k: f(s))
    with pytest.raises(NotImplementedError, match="custom_vjp"):
        mp.spec_texts(spec)


def test_negative_output_factor_stays_in_the_program():
    """-2 tanh(s / 2): the kernel folds only a positive output factor into the exp2 (it takes
    each row's max before scaling)."""
    for c, folded in ((-2.0, 1.0), (2.0, 2.0)):
        text = mp.spec_texts(make_spec(score_mod=lambda s, *_: c * jnp.tanh(s / 2.0))[0])["score"]
        _, _, _, (a, out_scale) = mp.kernel_programs(text, "")
        assert out_scale == folded and a == 0.5


def test_signed_zero_literals_are_not_merged():
    f = lambda s, b, h, q, k: jnp.maximum(s / 0.0, s / -0.0)
    assert _eval(f, "score", s=np.float32(-1.0), b=0, h=0, q=0, k=0) == np.inf


def test_float_to_int_saturates_as_xla():
    f = lambda s, b, h, q, k: (s * 1e9).astype(jnp.int32).astype(jnp.float32)
    for x in (3.0, -3.0, np.inf, -np.inf, np.nan, 0.7):
        got = _eval(f, "score", s=np.float32(x), b=0, h=0, q=0, k=0)
        want = jax.jit(lambda x: f(x, 0, 0, 0, 0))(jnp.float32(x))
        assert float(got) == float(want), x


class _Temperature:
    def __init__(self, t):
        self.t = t


def test_object_in_a_closure_read_anew_after_it_changes():
    """An eager call after a closed-over object's attribute changes traces the mod anew."""
    cfg = _Temperature(1.0)

    def make(c):
        return lambda s, b, h, q, k: s * c.t
    mod = make(cfg)
    q, k, v = _qkv()
    jaxflash.flash_attention(q, k, v, score_mod=mod, implementation="xla")
    cfg.t = 4.0
    out = jaxflash.flash_attention(q, k, v, score_mod=mod, implementation="xla")
    want = jaxflash.flash_attention(q, k, v, score_mod=lambda s, *_: s * 4.0,
                                    implementation="xla")
    np.testing.assert_allclose(out, want, atol=1e-5)
