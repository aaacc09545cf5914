"""A mask_mod equal to a built-in mask runs as the built-in (`jaxflash.kernels.mod_builtin`):
recognized exactly (element by element against `jaxflash.masking.keep`), refused for
everything else, the same result as the mod (and as the dense mask), and `explain` says so."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import masking, mods
from jaxflash.kernels import mod_builtin
from jaxflash.kernels.variants.mod_program import spec_texts
from tests.common import fresh_rng


def _form(mask_mod, T, S):
    return mod_builtin.builtin_form(spec_texts(mods.make_spec(None, mask_mod, ())[0])["mask"],
                                    T, S)


def _pattern(mask_mod, T, S):
    qi, ki = np.arange(T)[:, None], np.arange(S)[None, :]
    f = jax.vmap(jax.vmap(lambda q, k: mask_mod(0, 0, q, k), (None, 0)), (0, None))
    return np.asarray(f(jnp.asarray(qi[:, 0], jnp.int32), jnp.asarray(ki[0], jnp.int32)))


@pytest.mark.parametrize("T,S", [(37, 37), (53, 29), (20, 61)])
def test_builtin_masks_are_recognized_exactly(T, S):
    rng = fresh_rng()
    l, r = (int(x) for x in rng.integers(0, 12, 2))
    cases = [mods.causal(), mods.sliding_window(l, r), mods.sliding_window(l, 0),
             mods.and_masks(mods.causal(), mods.sliding_window(l, r)),
             lambda b, h, q, k: k >= 0]
    for m in cases:
        form = _form(m, T, S)
        assert form is not None, (m, T, S)
        is_causal, window = form
        keep = masking.keep(jnp.arange(T)[:, None], jnp.arange(S)[None, :],
                            is_causal=is_causal, window=window)
        want = np.ones((T, S), bool) if keep is None else np.asarray(keep)
        np.testing.assert_array_equal(want, _pattern(m, T, S))
    assert _form(mods.causal(), T, S) == (True, None)


def test_other_masks_stay_mods():
    T = S = 40
    for m in (mods.chunked(8), lambda b, h, q, k: k < q, lambda b, h, q, k: k < 0,
              lambda b, h, q, k: (k <= q) & (h == 0), lambda b, h, q, k: (k <= q) | (b > 0),
              lambda b, h, q, k: (q - k) % 2 == 0, mods.or_masks(mods.causal(), mods.chunked(8))):
        assert _form(m, T, S) is None, m
    # a mask reading aux (documents, a prefix length) is never evaluated here
    spec, _ = mods.make_spec(None, mods.document(), (jnp.zeros((1, 40), jnp.int32),))
    assert mod_builtin.builtin_form(spec_texts(spec)["mask"], T, S) is None


def test_recognized_mask_mod_gives_the_mods_result_and_says_so():
    rng = fresh_rng()
    B, T, S, N, H = 2, 45, 51, 2, 32
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.float32) for _ in range(2))
    mm = mods.sliding_window(9, 3)
    dense = jnp.asarray(_pattern(mm, T, S))[None, None]
    f = lambda q, k, v, **kw: jaxflash.flash_attention(q, k, v, implementation="xla", **kw)
    loss = lambda kw: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, **kw)))
    for kw in (dict(mask_mod=mm), dict(mask_mod=mm, score_mod=mods.softcap(3.0))):
        ref_kw = dict(mask=dense, **({"softcap": 3.0} if "score_mod" in kw else {}))
        np.testing.assert_allclose(f(q, k, v, **kw), f(q, k, v, **ref_kw), rtol=1e-5, atol=1e-6)
        g, gref = (jax.grad(loss(x), argnums=(0, 1, 2))(q, k, v) for x in (kw, ref_kw))
        for a, b in zip(g, gref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    text = str(jaxflash.explain(q, k, v, mask_mod=mm))
    assert "equals the built-in window local_window_size=(9, 3)" in text, text
    # with its BlockMask too: the built-in skips the same empty tiles by its bounds
    bm = mods.create_block_mask(mm, 1, 1, T, S, block=(16, 16))
    text = str(jaxflash.explain(q, k, v, mask_mod=mm, block_mask=bm))
    assert "equals the built-in window" in text and "block_mask is not needed" in text, text
    for impl in ("xla", "pallas"):
        got = jaxflash.flash_attention(q, k, v, mask_mod=mm, block_mask=bm, implementation=impl)
        np.testing.assert_allclose(got, f(q, k, v, mask=dense), rtol=1e-5, atol=1e-5)
