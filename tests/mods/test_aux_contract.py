"""What a call does with the mods' aux arrays: the ready-made mods check their shapes and
dtypes as the built-ins check theirs, narrow floating leaves are read (and differentiated) in
float32, and a mod with no derivative a kernel can compute is declined by the kernel backends,
not crashed on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mods
from tests.common import fresh_rng

B, T, S, N, K, D = 2, 37, 45, 4, 2, 16


def _qkv(dtype=jnp.float32):
    r = fresh_rng()
    shapes = ((B, T, N, D), (B, S, K, D), (B, S, K, D))
    return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in shapes)


@pytest.mark.parametrize("kw,match", [
    (dict(score_mod=mods.alibi(), aux=(jnp.ones((N - 1,)),)), r"slopes \[N\].*\(4,\).*got \(3,\)"),
    (dict(score_mod=mods.t5_bias(), aux=(jnp.ones((16, N)),)), r"\(32, 4\).*got \(16, 4\)"),
    (dict(score_mod=mods.t5_bias(), aux=(jnp.ones((32, N - 2)),)), r"got \(32, 2\)"),
    (dict(mask_mod=mods.document(), aux=(jnp.zeros((B, 20), jnp.int32),)), r">= 45.*got \(2, 20\)"),
    (dict(mask_mod=mods.document(), aux=(jnp.zeros((B, S), jnp.float32),)), "integer"),
    (dict(mask_mod=mods.prefix_lm(), aux=(jnp.ones((B + 1,), jnp.int32),)), r"got \(3,\)"),
    (dict(mask_mod=mods.and_masks(mods.causal(), mods.document(1)),
          aux=(jnp.zeros(()), jnp.zeros((B, 3), jnp.int32))), r"aux\[1\]"),
    (dict(score_mod=mods.alibi(2), aux=(jnp.ones((N,)),)), r"aux"),
])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ready_made_mods_check_their_aux(kw, match, impl):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        jaxflash.flash_attention(q, k, v, implementation=impl, **kw)


def test_broadcast_document_ids_accepted():
    """Ids [1, L] are every batch row's (a mod's read clamps to row 0), as documented."""
    q, k, v = _qkv()
    ids = jnp.asarray(np.repeat(np.arange(S) // 10, 1)[None], jnp.int32)
    a = jaxflash.flash_attention(q, k, v, mask_mod=mods.document(), aux=(ids,),
                                 implementation="xla")
    b = jaxflash.flash_attention(q, k, v, mask_mod=mods.document(),
                                 aux=(jnp.broadcast_to(ids, (B, S)),), implementation="xla")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bf16_table_gradient_sums_in_float32(impl):
    """A learnable bf16 T5 table: its gradient within bf16 rounding of the float32 one (the
    many (query, key) contributions to each entry are summed in float32)."""
    q, k, v = _qkv()
    r = fresh_rng()
    table = jnp.asarray(r.standard_normal((32, N)), jnp.float32)
    w = jnp.asarray(r.standard_normal((B, T, N, D)), jnp.float32)

    def g(tab):
        f = lambda t: jnp.sum(jaxflash.flash_attention(
            q, k, v, score_mod=mods.t5_bias(), aux=(t,), implementation=impl) * w)
        return jax.grad(f)(tab)
    t16 = table.astype(jnp.bfloat16)
    # the float32 gradient at the same (bf16-representable) table values
    want = np.asarray(g(t16.astype(jnp.float32)), np.float64)
    got = g(t16)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32), np.float64)
    big = np.abs(want) > 0.1 * np.abs(want).max()
    # the result's bf16 rounding (2^-9 relative), twice for margin
    assert np.max(np.abs(got - want)[big] / np.abs(want)[big]) < 4e-3


def test_callback_score_mod_declined_by_pallas_run_by_xla():
    def cb(s, b, h, q, k):
        return jax.pure_callback(lambda x: (np.asarray(x) * 2).astype(np.float32),
                                 jax.ShapeDtypeStruct((), jnp.float32), s,
                                 vmap_method="broadcast_all")
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError):
        jaxflash.flash_attention(q, k, v, score_mod=cb, implementation="pallas")
    out = jaxflash.flash_attention(q, k, v, score_mod=cb, implementation="xla")
    ref = jaxflash.flash_attention(q, k, v, score_mod=lambda s, *_: s * 2,
                                   implementation="xla")
    np.testing.assert_allclose(out, ref, atol=1e-6)
