"""Flax integration: `attention_fn` inside Flax's own attention modules, the NNX and Linen
`FlashMultiHeadAttention` layers against Flax's attention with the same parameters, fallbacks,
KV-cache decoding, remat, jit and parameter sharding over the 8 host devices."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import jaxflash
import jaxflash.flax_layers as fl
from tests.common import assert_close, assert_sum_close, bernoulli, fresh_key, randint, randn

FWD, GRAD = 2e-5, 1e-4
# Layers are called and differentiated under (nnx.)jit throughout: eagerly every primitive
# compiles on its own (about 5x the time on the 2-core CI machine). Eager calls stay where the
# test is about them (the fallbacks' logging, sown weights, Flax's own decode loop).


def _inputs(shape):
    return randn(shape)  # NumPy draws: an eager jax.random draw compiles per shape


def _tree_close(a, b, tol, what):
    """Leaf-wise relative L2; a leaf that is zero in exact arithmetic (the key-projection bias
    gradient: softmax ignores a shift shared by all keys) is compared against the tree's norm."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la, f"{what}: trees differ ({len(la)} vs {len(lb)} leaves)"
    total = np.sqrt(sum(float(np.sum(np.square(np.asarray(y, np.float64)))) for y in lb))
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        if np.linalg.norm(y) < tol * total:
            assert not np.any(np.isnan(x)), f"{what}[{i}]: NaN"
            err = np.linalg.norm(x - y) / total
            assert err <= tol, f"{what}[{i}] (near-zero leaf): error {err:.2e} of the tree norm"
        else:
            assert_close(x, y, tol, f"{what}[{i}]")


def _nnx_loss_grads(model, x, w, **call):
    def loss(m, x):
        return jnp.sum(m(x, **call) * w)
    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(model, x)


def _padding_mask(B, T):
    """Flax-style float mask [B, 1, T, T] of random key padding; key 0 always valid, so no row is
    empty (there Flax averages the values while jaxflash gives 0, by design)."""
    valid = np.array(bernoulli(0.7, (B, T)))
    valid[:, 0] = True  # (what nnx.make_attention_mask(ones, valid) gives, without compiling)
    return jnp.asarray(np.broadcast_to(valid[:, None, None, :], (B, 1, T, T)).astype(np.float32))


# --------------------------------------------------------------------------------------------
# attention_fn inside Flax's own modules

@pytest.mark.parametrize("variant", ["plain", "mask", "causal_gqa"])
def test_attention_fn_in_nnx_mha(variant):
    B, T, F, N = 2, 9, 32, 4
    kv = 2 if variant == "causal_gqa" else None
    mk = lambda fn: nnx.MultiHeadAttention(N, F, num_kv_heads=kv, decode=False, attention_fn=fn,
                                           rngs=nnx.Rngs(3))
    ref, ours = mk(nnx.dot_product_attention), mk(fl.attention_fn)
    nnx.update(ours, nnx.state(ref, nnx.Param))
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    call = {}
    if variant == "mask":
        call["mask"] = _padding_mask(B, T)
    if variant == "causal_gqa":
        call["is_causal"] = True

    fwd = nnx.jit(lambda m, x: m(x, **call))
    assert_close(fwd(ours, x), fwd(ref, x), FWD, "out")
    assert fl.last_fallback_reason is None
    (l0, g0), (l1, g1) = _nnx_loss_grads(ref, x, w, **call), _nnx_loss_grads(ours, x, w, **call)
    _tree_close(g1, g0, GRAD, "grads")


def test_attention_fn_in_linen_mha_jit_and_grads():
    B, T, F, N = 2, 11, 32, 4
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    mask = _padding_mask(B, T)
    ref = linen.MultiHeadDotProductAttention(num_heads=N)
    ours = linen.MultiHeadDotProductAttention(num_heads=N, attention_fn=fl.attention_fn)
    params = jax.jit(lambda k, x: ref.init(k, x, mask=mask))(fresh_key(), x)

    def loss(mod, p, x):
        return jnp.sum(mod.apply(p, x, mask=mask) * w)

    out_r = jax.jit(lambda p, x: ref.apply(p, x, mask=mask))(params, x)
    out_o = jax.jit(lambda p, x: ours.apply(p, x, mask=mask))(params, x)
    assert out_o.shape == out_r.shape == (B, T, F)
    assert_close(out_o, out_r, FWD, "out")
    g_r = jax.jit(jax.grad(lambda p, x: loss(ref, p, x), argnums=(0, 1)))(params, x)
    g_o = jax.jit(jax.grad(lambda p, x: loss(ours, p, x), argnums=(0, 1)))(params, x)
    _tree_close(g_o, g_r, GRAD, "grads")


def test_attention_fn_in_nnx_mha_decode():
    """Flax's own decode loop (float masks from combine_masks, cache) through attention_fn."""
    B, L, F, N = 2, 6, 16, 2
    mk = lambda fn: nnx.MultiHeadAttention(N, F, decode=True, attention_fn=fn, rngs=nnx.Rngs(5))
    ref, ours = mk(nnx.dot_product_attention), mk(fl.attention_fn)
    nnx.update(ours, nnx.state(ref, nnx.Param))
    for m in (ref, ours):
        m.init_cache((B, L, F))
    x = _inputs((B, L, F))
    step = nnx.jit(lambda m, x: m(x))  # one compile per model; the cache index is state
    for t in range(L):
        xt = x[:, t:t + 1]
        assert_close(step(ours, xt), step(ref, xt), FWD, f"step {t}")


def test_make_attention_fn_binds_is_causal():
    """``make_attention_fn(is_causal=True)`` in Flax's attention: Flax's own causal mask."""
    B, T, F, N = 2, 7, 16, 2
    mk = lambda fn: nnx.MultiHeadAttention(N, F, decode=False, attention_fn=fn, rngs=nnx.Rngs(2))
    ref, ours = mk(nnx.dot_product_attention), mk(fl.make_attention_fn(is_causal=True))
    nnx.update(ours, nnx.state(ref, nnx.Param))
    x = _inputs((B, T, F))
    want = ref(x, mask=nnx.make_causal_mask(jnp.ones((B, T))))
    assert_close(nnx.jit(lambda m, x: m(x))(ours, x), want, FWD, "bound causal")


# --------------------------------------------------------------------------------------------
# Fallbacks: dropout and sown weights go to the weights path, visibly, and stay correct

def test_dropout_fallback_matches_flax_and_is_visible(caplog):
    B, T, F, N = 2, 8, 16, 2
    mk = lambda fn: nnx.MultiHeadAttention(N, F, dropout_rate=0.4, decode=False,
                                           attention_fn=fn, rngs=nnx.Rngs(params=1, dropout=7))
    fl.reset_fallback_record()
    for broadcast in (True, False):
        ref, ours = mk(nnx.dot_product_attention), mk(fl.attention_fn)
        ref.broadcast_dropout = ours.broadcast_dropout = broadcast
        x = _inputs((B, T, F))
        with caplog.at_level(logging.WARNING, logger="jaxflash.flax"):
            y_o = ours(x, deterministic=False)
        y_r = ref(x, deterministic=False)  # same dropout stream state -> same keep mask
        assert "dropout" in fl.last_fallback_reason
        assert_close(y_o, y_r, FWD, f"dropout out (broadcast={broadcast})")
        y_det = ours(x, deterministic=True)
        assert fl.last_fallback_reason is None
        assert rel_diff(y_o, y_det) > 1e-2, "dropout had no effect"
    warned = [r for r in caplog.records if "dropout" in r.getMessage()]
    assert len(warned) == 1, "the fallback must be logged exactly once per reason"
    assert sum(v for k, v in fl.fallback_counts.items() if "dropout" in k) == 2


def rel_diff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_dropout_without_rng_is_a_value_error():
    q = _inputs((1, 4, 2, 8))
    with pytest.raises(ValueError, match="dropout_rng"):
        fl.attention_fn(q, q, q, dropout_rate=0.5, deterministic=False)


def test_sow_weights_nnx_and_linen():
    B, T, F, N = 2, 7, 16, 2
    x = _inputs((B, T, F))
    mk = lambda fn: nnx.MultiHeadAttention(N, F, decode=False, attention_fn=fn,
                                           rngs=nnx.Rngs(2))
    ref, ours = mk(nnx.dot_product_attention), mk(fl.attention_fn)
    y_r, y_o = ref(x, sow_weights=True, is_causal=True), ours(x, sow_weights=True,
                                                               is_causal=True)
    assert "sow" in fl.last_fallback_reason
    assert_close(y_o, y_r, FWD, "out")
    w_r = nnx.state(ref, nnx.Intermediate)["attention_weights"][0]
    w_o = nnx.state(ours, nnx.Intermediate)["attention_weights"][0]
    assert w_o.shape == (B, N, T, T)
    assert_close(w_o, w_r, FWD, "sown weights")

    lr = linen.MultiHeadDotProductAttention(num_heads=N)
    lo = linen.MultiHeadDotProductAttention(num_heads=N, attention_fn=fl.attention_fn)
    p = jax.jit(lr.init)(fresh_key(), x)
    (_, st_r) = lr.apply(p, x, sow_weights=True, mutable=["intermediates"])
    (y, st_o) = lo.apply(p, x, sow_weights=True, mutable=["intermediates"])
    assert "sow" in fl.last_fallback_reason
    _tree_close(st_o, st_r, FWD, "linen sown weights")


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_attention_fn_any_batch_dims_matches_flax(batch):
    T, N, H = 6, 2, 8
    q, k, v = (_inputs(batch + (T, N, H)) for _ in range(3))
    bias = randn(batch + (N, T, T), scale=0.3)
    mask = np.array(bernoulli(0.7, batch + (1, T, T)))
    mask[..., 0] = True
    ours, ref = jax.jit(lambda q, k, v, bias, mask: (
        fl.attention_fn(q, k, v, bias=bias, mask=mask),
        nnx.dot_product_attention(q, k, v, bias=bias, mask=mask)))(q, k, v, bias, mask)
    assert_close(ours, ref, FWD, f"batch {batch}")


def test_unknown_keywords_accepted_only_when_they_ask_for_nothing():
    q = _inputs((2, 5, 2, 8))
    ours, ref = jax.jit(lambda q: (fl.attention_fn(q, q, q, future_option=None, other=False),
                                   jaxflash.flash_attention(q, q, q, implementation="xla")))(q)
    assert_close(ours, ref, FWD, "out")
    with pytest.raises(NotImplementedError, match="future_option"):
        fl.attention_fn(q, q, q, future_option=0.5)


def test_custom_einsum_goes_to_weights_path():
    q, k, v = (_inputs((2, 5, 4, 8)) for _ in range(3))
    calls = []

    def einsum(sub, a, b):
        calls.append(sub)
        return jnp.einsum(sub, a, b, precision=jax.lax.Precision.HIGHEST)

    k, v = k[..., :2, :], v[..., :2, :]
    out = jax.jit(lambda q, k, v: fl.attention_fn(
        q, k, v, qk_attn_weights_einsum=einsum, attn_weights_value_einsum=einsum,
        is_causal=True))(q, k, v)
    assert len(calls) == 2 and "einsum" in fl.last_fallback_reason
    ref = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                           implementation="xla"))(q, k, v)
    assert_close(out, ref, FWD, "custom einsum path")


# --------------------------------------------------------------------------------------------
# FlashMultiHeadAttention (NNX) against Flax's attention with the same parameters

@pytest.mark.parametrize("variant", ["causal", "gqa_qknorm", "bf16"])
def test_flash_mha_nnx_matches_flax(variant):
    B, T, F, N = 2, 10, 32, 4
    kv = 2 if variant == "gqa_qknorm" else None
    qkn = variant == "gqa_qknorm"
    dt = jnp.bfloat16 if variant == "bf16" else None
    ref = nnx.MultiHeadAttention(N, F, num_kv_heads=kv, normalize_qk=qkn, dtype=dt,
                                 decode=False, rngs=nnx.Rngs(0))
    ours = fl.FlashMultiHeadAttention(N, F, num_kv_heads=kv, normalize_qk=qkn, dtype=dt,
                                      is_causal=True, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(ref, nnx.Param))
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    fwd_tol, grad_tol = (2e-2, 5e-2) if dt else (FWD, GRAD)
    y_o = nnx.jit(lambda m, x: m(x))(ours, x)
    y_r = nnx.jit(lambda m, x: m(x, is_causal=True))(ref, x)
    assert y_o.dtype == y_r.dtype
    assert_close(y_o, y_r, fwd_tol, "out")
    (_, g_o), (_, g_r) = _nnx_loss_grads(ours, x, w), _nnx_loss_grads(ref, x, w, is_causal=True)
    _tree_close(nnx.state(g_o[0], nnx.Param), nnx.state(g_r[0], nnx.Param), grad_tol, "params")
    assert_close(g_o[1], g_r[1], grad_tol, "dx")


def test_flash_mha_nnx_cross_attention_and_remat():
    B, T, S, F, N = 2, 6, 9, 16, 2
    ref = nnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0))
    ours = fl.FlashMultiHeadAttention(N, F, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(ref, nnx.Param))
    xq, xkv, w = _inputs((B, T, F)), _inputs((B, S, F)), _inputs((B, T, F))
    cross = nnx.jit(lambda m, xq, xkv: m(xq, xkv))
    assert_close(cross(ours, xq, xkv), cross(ref, xq, xkv), FWD, "cross-attention out")

    def loss(m, x):
        return jnp.sum(m(x, xkv) * w)

    def remat_loss(m, x):
        return jnp.sum(nnx.remat(lambda m, x: m(x, xkv))(m, x) * w)

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    g_plain = grad(ours, xq)
    g_remat = nnx.jit(nnx.grad(remat_loss, argnums=(0, 1)))(ours, xq)
    g_ref = grad(ref, xq)
    _tree_close(nnx.state(g_remat[0], nnx.Param), nnx.state(g_plain[0], nnx.Param), GRAD, "remat")
    _tree_close(nnx.state(g_plain[0], nnx.Param), nnx.state(g_ref[0], nnx.Param), GRAD, "vs flax")


def test_flash_mha_segment_ids_and_window_match_masked_flax():
    B, T, F, N = 2, 12, 16, 2
    ref = nnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0))
    ours = fl.FlashMultiHeadAttention(N, F, is_causal=True, local_window_size=(3, 0),
                                      softcap=None, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(ref, nnx.Param))
    x = _inputs((B, T, F))
    seg = np.sort(np.asarray(randint(0, 3, (B, T))), axis=-1)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    dense = (seg[:, None, :, None] == seg[:, None, None, :]) & (j <= i) & (j >= i - 3)
    got = nnx.jit(lambda m, x, seg: m(x, segment_ids=seg))(ours, x, seg)
    want = nnx.jit(lambda m, x, dense: m(x, mask=dense))(ref, x, dense)
    assert_close(got, want, FWD, "segments + window")


def test_softcap_rope_against_direct_computation():
    B, T, F, N = 2, 8, 16, 2
    m = fl.FlashMultiHeadAttention(N, F, is_causal=True, softcap=5.0, rope=True, rngs=nnx.Rngs(0))
    x = _inputs((B, T, F))

    @nnx.jit
    def direct(m, x):
        q, k, v = m.query(x), m.key(x), m.value(x)
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        q, k = fl.apply_rope(q, pos), fl.apply_rope(k, pos)
        return m.out(jaxflash.flash_attention(q, k, v, is_causal=True, softcap=5.0,
                                              implementation="xla"))

    assert_close(nnx.jit(lambda m, x: m(x))(m, x), direct(m, x), FWD, "softcap + rope")


def test_apply_rope_is_relative_and_matches_complex_rotation():
    T, N, H = 7, 2, 8
    q, k = _inputs((1, T, N, H)), _inputs((1, T, N, H))
    pos = jnp.arange(T)[None]
    shift = 13
    scores = jax.jit(lambda q, k, pos: jnp.einsum("btnh,bsnh->bnts", fl.apply_rope(q, pos),
                                                  fl.apply_rope(k, pos)))
    s0, s1 = scores(q, k, pos), scores(q, k, pos + shift)
    assert_close(s1, s0, 1e-5, "shift invariance")
    half = H // 2
    z = np.asarray(q[..., :half]) + 1j * np.asarray(q[..., half:])
    ang = np.arange(T)[None, :, None, None] * 10000.0 ** (-np.arange(half) / half)
    zr = z * np.exp(1j * ang)
    want = np.concatenate([zr.real, zr.imag], axis=-1)
    assert_close(jax.jit(fl.apply_rope)(q, pos), want, 1e-5, "complex rotation")
    with pytest.raises(ValueError, match="even head dim"):
        fl.apply_rope(q[..., :3], pos)


# --------------------------------------------------------------------------------------------
# KV-cache decoding equals the full causal forward

@pytest.mark.parametrize("variant", ["rope_gqa", "window_softcap"])
def test_nnx_kv_cache_decode_equals_full_forward(variant):
    B, L, F, N = 2, 9, 32, 4
    kw = (dict(num_kv_heads=2, rope=True) if variant == "rope_gqa"
          else dict(local_window_size=(2, 0), softcap=4.0))
    m = fl.FlashMultiHeadAttention(N, F, is_causal=True, rngs=nnx.Rngs(0), **kw)
    x = np.asarray(_inputs((B, L, F)))  # (sliced in NumPy: each eager slice would compile)
    full = nnx.jit(lambda m, x: m(x))(m, x)
    m.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [step(m, x[:, :3])]                           # a prefill chunk of 3 tokens
    outs += [step(m, x[:, t:t + 1]) for t in range(3, L)]  # then one token at a time
    assert int(m.cache_index[...]) == L
    assert_close(np.concatenate(outs, axis=1), full, FWD, "decode vs full")


def test_nnx_kv_cache_decode_without_causal_mask():
    """A layer without a causal mask decodes a chunk as the full forward of what is written:
    every new token sees every key written so far, its own chunk's included."""
    B, L, F, N = 2, 6, 32, 4
    m = fl.FlashMultiHeadAttention(N, F, rngs=nnx.Rngs(1))
    x = np.asarray(_inputs((B, L, F)))
    fwd = nnx.jit(lambda m, x: m(x))
    m.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    assert_close(step(m, x[:, :3]), fwd(m, x[:, :3]), FWD, "prefill chunk")
    assert_close(step(m, x[:, 3:5]), fwd(m, x[:, :5])[:, 3:5], FWD, "second chunk")
    assert_close(step(m, x[:, 5:6]), fwd(m, x)[:, 5:6], FWD, "one token")


def test_linen_layer_matches_flax_and_decodes():
    B, L, F, N = 2, 8, 32, 4
    x, w = _inputs((B, L, F)), _inputs((B, L, F))
    ref = linen.MultiHeadDotProductAttention(num_heads=N, normalize_qk=True)
    ours = fl.LinenFlashMultiHeadAttention(num_heads=N, normalize_qk=True, is_causal=True)
    params = jax.jit(ref.init)(fresh_key(), x)
    assert (jax.tree.structure(jax.eval_shape(ours.init, fresh_key(), x))
            == jax.tree.structure(params))
    mask = np.tril(np.ones((L, L), bool))[None, None]  # nnx.make_causal_mask, in NumPy
    y_r = jax.jit(lambda p, x: ref.apply(p, x, mask=mask))(params, x)
    y_o = jax.jit(ours.apply)(params, x)
    assert_close(y_o, y_r, FWD, "linen out")
    g_r = jax.jit(jax.grad(lambda p: jnp.sum(ref.apply(p, x, mask=mask) * w)))(params)
    g_o = jax.jit(jax.grad(lambda p: jnp.sum(ours.apply(p, x) * w)))(params)
    _tree_close(g_o, g_r, GRAD, "linen grads")
    seg = np.sort(np.asarray(randint(0, 3, (B, L))), axis=-1)
    seg_mask = (seg[:, None, :, None] == seg[:, None, None, :]) & mask
    got = jax.jit(lambda p, x, seg: ours.apply(p, x, segment_ids=seg))(params, x, seg)
    want = jax.jit(lambda p, x, m: ref.apply(p, x, mask=m))(params, x, seg_mask)
    assert_close(got, want, FWD, "linen segment ids")

    # GQA + rope, decoding with the Linen cache convention.
    dec = fl.LinenFlashMultiHeadAttention(num_heads=N, num_kv_heads=2, is_causal=True, rope=True,
                                          decode=True)
    full_mod = dec.clone(decode=False)
    v = jax.jit(dec.init)(fresh_key(), x)
    p, cache = v["params"], v["cache"]
    full = jax.jit(lambda p, x: full_mod.apply({"params": p}, x))(p, x)
    step = jax.jit(lambda p, c, xt: dec.apply({"params": p, "cache": c}, xt, mutable=["cache"]))
    outs, xn = [], np.asarray(x)
    for lo, hi in ((0, 2), (2, 3), (3, 4), (4, 8)):
        y, upd = step(p, cache, xn[:, lo:hi])
        cache = upd["cache"]
        outs.append(y)
    assert_close(np.concatenate(outs, axis=1), full, FWD, "linen decode vs full")


# --------------------------------------------------------------------------------------------
# Parameter sharding over a mesh of the 8 host devices

def test_sharded_params_and_batch_match_unsharded():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets them)")
    # Auto axes: XLA propagates shardings through the projections (explicit-mode meshes would
    # need out_sharding on every contraction over a sharded axis).
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    B, T, F, N = 4, 8, 32, 4
    init = nnx.initializers.lecun_normal()
    ref_model = fl.FlashMultiHeadAttention(N, F, num_kv_heads=4, is_causal=True, rope=True,
                                           rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):  # Flax places annotated parameters on the mesh as it creates them
        model = fl.FlashMultiHeadAttention(
            N, F, num_kv_heads=4, is_causal=True, rope=True, rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(init, (None, "model", None)),
            out_kernel_init=nnx.with_partitioning(init, ("model", None, None)))
    # Same values as the unsharded model, keeping each parameter's sharding.
    dst = nnx.state(model, nnx.Param)
    vals = jax.tree.map(lambda s, d: jax.device_put(s, d.sharding),
                        nnx.to_pure_dict(nnx.state(ref_model, nnx.Param)), nnx.to_pure_dict(dst))
    nnx.replace_by_pure_dict(dst, vals)
    nnx.update(model, dst)
    assert model.query.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model",
                                                                                None)
    assert len(model.query.kernel[...].sharding.device_set) == 8
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))

    @nnx.jit
    def step(m, x):
        return nnx.value_and_grad(lambda m, x: jnp.sum(m(x) * w))(m, x)

    (l_s, g_s), (l_r, g_r) = step(model, xs), step(ref_model, x)
    fwd = nnx.jit(lambda m, x: m(x))
    out_r = fwd(ref_model, x)
    assert_close(fwd(model, xs), out_r, FWD, "output")
    # A relative check of the loss itself failed at 1.5e-4 on 2026-12-01 (terms cancelling).
    assert_sum_close(l_s, l_r, np.asarray(out_r) * np.asarray(w), FWD, "loss")
    _tree_close(nnx.state(g_s, nnx.Param), nnx.state(g_r, nnx.Param), GRAD, "sharded grads")
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model", None))
    assert g_s.query.kernel[...].sharding.is_equivalent_to(want, 3), "grads left the mesh layout"


# --------------------------------------------------------------------------------------------
# The layers on the Pallas kernels (interpret mode on CPU: small sizes)

@pytest.mark.slow
def test_layers_on_pallas_backend():
    B, T, F, N = 1, 16, 32, 2
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    kw = dict(num_kv_heads=1, is_causal=True, rope=True, softcap=20.0)
    ours = fl.FlashMultiHeadAttention(N, F, rngs=nnx.Rngs(0), **kw)
    ours.implementation = "pallas"  # the attribute is assignable after construction
    assert ours.opts.implementation == "pallas"
    ref = fl.FlashMultiHeadAttention(N, F, implementation="xla", rngs=nnx.Rngs(1), **kw)
    nnx.update(ref, nnx.state(ours, nnx.Param))
    @nnx.jit  # output and gradients in one program (interpret-mode kernels compile slowly)
    def out_and_grads(m, x):
        def loss(m, x):
            y = m(x)
            return jnp.sum(y * w), y
        return nnx.grad(loss, argnums=(0, 1), has_aux=True)(m, x)

    (g_o, y_o), (g_r, y_r) = out_and_grads(ours, x), out_and_grads(ref, x)
    assert_close(y_o, y_r, FWD, "pallas layer out")
    _tree_close(nnx.state(g_o[0], nnx.Param), nnx.state(g_r[0], nnx.Param), GRAD, "pallas grads")

    # Decoding on pallas: a prefill chunk (dense mask) then single tokens (kv_seq_lengths).
    ours.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    xn = np.asarray(x)
    outs = [step(ours, xn[:, :14])] + [step(ours, xn[:, t:t + 1]) for t in range(14, T)]
    assert_close(np.concatenate(outs, axis=1), y_r, FWD, "pallas decode vs full")

    mha = nnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(1),
                                 attention_fn=fl.make_attention_fn(implementation="pallas"))
    mask = _padding_mask(B, T)
    y = nnx.jit(lambda m, x: m(x, mask=mask))(mha, x)
    mha.attention_fn = nnx.dot_product_attention
    assert_close(y, nnx.jit(lambda m, x: m(x, mask=mask))(mha, x), FWD, "attention_fn on pallas")


def test_layers_take_mods_with_aux_at_call():
    """score_mod / mask_mod on both layers, their arrays (here learnable ALiBi slopes) passed
    at each call as aux: the same output and gradients (slopes included) as the layer's own
    projections around flash_attention with the built-in ALiBi; decoding refuses mods."""
    from jaxflash import mods
    B, T, F, N = 2, 9, 32, 4
    x, w = _inputs((B, T, F)), _inputs((B, T, F))
    slopes = jnp.asarray(np.random.default_rng().uniform(0.1, 1.0, N), jnp.float32)
    layer = fl.FlashMultiHeadAttention(N, F, score_mod=mods.alibi(), mask_mod=mods.causal(),
                                       rngs=nnx.Rngs(0))

    def by_hand(m, x, s):
        o = jaxflash.flash_attention(m.query(x), m.key(x), m.value(x), is_causal=True,
                                     alibi_slopes=s)
        return m.out(o)

    loss = lambda f: nnx.jit(nnx.value_and_grad(
        lambda m, s: jnp.sum(f(m, x, s) * w), argnums=(0, 1)))(layer, slopes)
    (l_mod, (gm_mod, gs_mod)), (l_ref, (gm_ref, gs_ref)) = (
        loss(lambda m, x, s: m(x, aux=(s,))), loss(by_hand))
    assert_close(l_mod, l_ref, FWD, "loss")
    assert_close(gs_mod, gs_ref, GRAD, "dslopes")
    assert float(jnp.max(jnp.abs(gs_mod))) > 0
    _tree_close(nnx.state(gm_mod, nnx.Param), nnx.state(gm_ref, nnx.Param), GRAD, "params")

    lin = fl.LinenFlashMultiHeadAttention(num_heads=N, score_mod=mods.alibi(),
                                          mask_mod=mods.causal())
    params = lin.init(fresh_key(), x, aux=(slopes,))
    plain = fl.LinenFlashMultiHeadAttention(num_heads=N, is_causal=True)
    y0 = lin.apply(params, x, aux=(jnp.zeros_like(slopes),))   # slopes 0: causal alone
    assert_close(y0, plain.apply(params, x), FWD, "linen, zero slopes")
    g = jax.grad(lambda s: jnp.sum(lin.apply(params, x, aux=(s,)) * w))(slopes)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.max(jnp.abs(g))) > 0

    fn = fl.make_attention_fn(score_mod=mods.alibi(), mask_mod=mods.causal(), aux=(slopes,))
    q = _inputs((B, T, N, 8))
    assert_close(fn(q, q, q), jaxflash.flash_attention(q, q, q, is_causal=True,
                                                       alibi_slopes=slopes), FWD, "attention_fn")
    with pytest.raises(NotImplementedError, match="weights path"):
        fn(q, q, q, dropout_rate=0.1, dropout_rng=fresh_key())

    layer.init_cache((B, T, F))
    with pytest.raises(NotImplementedError, match="incremental decoding"):
        layer(x[:, :1], aux=(slopes,), decode=True)
    with pytest.raises(ValueError, match="aux given"):
        fl.FlashMultiHeadAttention(N, F, rngs=nnx.Rngs(0))(x, aux=(slopes,))


def test_bound_causal_attention_fn_in_flax_decode():
    """make_attention_fn(is_causal=True) inside Flax's own decode loop: each step (one query
    against the cache) is masked by Flax's cache mask, not by a top-left causal one, so the
    steps equal the causal full forward."""
    B, L, F, N = 2, 5, 16, 2
    fn = fl.make_attention_fn(is_causal=True)
    train = nnx.MultiHeadAttention(N, F, decode=False, attention_fn=fn, rngs=nnx.Rngs(4))
    dec = nnx.MultiHeadAttention(N, F, decode=True, attention_fn=fn, rngs=nnx.Rngs(4))
    nnx.update(dec, nnx.state(train, nnx.Param))
    x = np.asarray(_inputs((B, L, F)))
    full = nnx.jit(lambda m, x: m(x))(train, x)
    dec.init_cache((B, L, F))
    step = nnx.jit(lambda m, x: m(x))
    outs = np.concatenate([step(dec, x[:, t:t + 1]) for t in range(L)], axis=1)
    assert_close(outs, full, FWD, "decode steps vs causal forward")


def test_rope_positions_need_key_positions_for_separate_keys():
    """rope with positions given and keys from a separate array: kv_positions must be given
    (self-attention on a copy and cross-attention cannot be told apart); self-attention by
    identity takes the query positions."""
    B, T, F, N = 1, 6, 16, 2
    m = fl.FlashMultiHeadAttention(N, F, is_causal=True, rope=True, rngs=nnx.Rngs(0))
    x = _inputs((B, T, F))
    pos = jnp.asarray(np.arange(3, 3 + T)[None])
    with pytest.raises(ValueError, match="kv_positions"):
        m(x, jnp.array(x), positions=pos)
    assert_close(m(x, jnp.array(x), positions=pos, kv_positions=pos), m(x, positions=pos), FWD,
                 "explicit key positions")


def test_decode_past_the_cache_is_refused():
    """A chunk that would run past the cache raises (eagerly) instead of overwriting keys."""
    B, L, F, N = 1, 6, 16, 2
    m = fl.FlashMultiHeadAttention(N, F, is_causal=True, rngs=nnx.Rngs(0))
    x = np.asarray(_inputs((B, 7, F)))
    m.init_cache((B, L, F))
    m(x[:, :4], decode=True)
    with pytest.raises(ValueError, match="cache length 6"):
        m(x[:, 4:7], decode=True)


def test_nnx_layer_takes_flax_call_arguments():
    """The NNX layer takes nnx.MultiHeadAttention's call arguments: is_causal at the call
    (equal to the layer's own flag), deterministic / rngs (no dropout here: no effect), and
    refuses sow_weights by name."""
    B, T, F, N = 2, 7, 16, 2
    plain = fl.FlashMultiHeadAttention(N, F, rngs=nnx.Rngs(0))
    causal = fl.FlashMultiHeadAttention(N, F, is_causal=True, rngs=nnx.Rngs(0))
    x = _inputs((B, T, F))
    assert_close(plain(x, is_causal=True), causal(x), FWD, "call-level is_causal")
    assert_close(plain(x, deterministic=False, rngs=nnx.Rngs(1)), plain(x), FWD, "deterministic")
    with pytest.raises(NotImplementedError, match="sow_weights"):
        plain(x, sow_weights=True)


def test_layers_take_flax_constructor_arguments():
    """Both layers take Flax's constructor arguments for the projections (precision, the out
    bias init / metadata, the LayerNorm scale metadata) with Flax's meaning, and refuse a
    nonzero dropout_rate by name (the kernels have no dropout)."""
    B, T, F, N = 2, 5, 16, 2
    x = _inputs((B, T, F))
    ones = nnx.initializers.ones
    m = fl.FlashMultiHeadAttention(N, F, out_bias_init=ones, precision="highest",
                                   normalize_qk=True, out_bias_metadata={"tag": "ob"},
                                   query_ln_scale_metadata={"tag": "qs"}, rngs=nnx.Rngs(0))
    assert np.all(np.asarray(m.out.bias[...]) == 1.0)
    assert m.out.bias.get_metadata()["tag"] == "ob"
    assert m.query_ln.scale.get_metadata()["tag"] == "qs"
    assert m(x).shape == (B, T, F)
    with pytest.raises(NotImplementedError, match="dropout"):
        fl.FlashMultiHeadAttention(N, F, dropout_rate=0.1, rngs=nnx.Rngs(0))
    lin = fl.LinenFlashMultiHeadAttention(num_heads=N, out_bias_init=linen.initializers.ones,
                                          precision="highest")
    params = lin.init(jax.random.key(0), x)
    assert np.all(np.asarray(params["params"]["out"]["bias"]) == 1.0)
    with pytest.raises(NotImplementedError, match="dropout"):
        fl.LinenFlashMultiHeadAttention(num_heads=N, dropout_rate=0.1).init(jax.random.key(0), x)
