"""Degenerate shapes on every backend that runs here ("xla", "pallas" in interpret mode) and, for
"cute", through `explain` and lowering for CUDA (no GPU needed).

Decided behaviour (documented in `jaxflash.flash_attention`, "Empty and degenerate shapes"):
- a zero-sized batch dim or T = 0: an empty output (and LSE) of the right shapes, empty
  gradients, like any jnp op;
- S = 0: every query row has no key, so output 0 and LSE -inf (the documented fully masked
  row), gradients 0 (empty for k and v);
- in both cases no backend runs (no kernel is launched on an empty grid), but a backend named
  by ``implementation=`` must serve the configuration as it must for a non-empty call;
- N, K, H or Hv = 0: ValueError (no head grouping, no default scale);
- `ring_attention` keeps refusing empty calls with a ValueError (its blocks reach the backends);
- T = 1, S = 1, T != S with either 1, N = K = 1: served and correct (float64 NumPy model);
- head dims a backend does not serve: `explain` shows the reason and the next backend runs;
- transposed, sliced and broadcast inputs: correct (XLA materializes what a kernel needs).

`jax.vmap` over a size-0 axis is an empty call too (flash_attention reads the mapped size from
the vmap tracer): no backend runs, forward and gradients; the CuTe bridge's batching rule
(`jaxflash/ffi/primitive.py`) also returns empty outputs without a launch on its own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests.extremes import npref

IMPLS = ("xla", "pallas")


def _rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _w(shape):
    return _rand(shape, 99)


@functools.lru_cache(maxsize=None)
def _value_and_grads(impl, kwargs_items, has_bias):
    """One jitted program per (backend, static config): (out, lse) and d/d(q, k, v[, bias]) of
    sum(out * w)."""
    kwargs = dict(kwargs_items)

    def loss(q, k, v, bias, w, arrays):
        out, lse = jaxflash.flash_attention(q, k, v, bias, implementation=impl,
                                            return_residual=True, **kwargs, **arrays)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    argnums = (0, 1, 2, 3) if has_bias else (0, 1, 2)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def _run(impl, q, k, v, bias=None, arrays=None, **kwargs):
    w = _w(q.shape[:-1] + (v.shape[-1],))
    fn = _value_and_grads(impl, tuple(sorted(kwargs.items())), bias is not None)
    (_, (out, lse)), grads = fn(q, k, v, bias, w, arrays or {})
    return out, lse, grads, w


# ------------------------------------------------------------------------------ empty calls
_EMPTY = [  # (id, batch dims, T, S)
    ("B=0", (0,), 4, 5),
    ("B=(3,0)", (3, 0), 4, 5),
    ("T=0", (2,), 0, 5),
    ("S=0", (2,), 4, 0),
    ("T=S=0", (2,), 0, 0),
    ("B=0,S=0", (0,), 3, 0),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bdims,T,S", [c[1:] for c in _EMPTY], ids=[c[0] for c in _EMPTY])
def test_empty_call_gives_empty_or_fully_masked_result(impl, bdims, T, S):
    N, K, H, Hv = 4, 2, 8, 6
    q = _rand(bdims + (T, N, H), 1, jnp.bfloat16)
    k = _rand(bdims + (S, K, H), 2, jnp.bfloat16)
    v = _rand(bdims + (S, K, Hv), 3, jnp.bfloat16)
    bias = _rand(bdims + (1, T, S), 4)  # every optional array is validated with zero dims too
    lens = jnp.zeros(bdims, jnp.int32)
    arrays = dict(mask=jnp.ones(bdims + (N, T, S), bool), query_seq_lengths=lens + T,
                  key_value_seq_lengths=lens + S, q_segment_ids=jnp.zeros(bdims + (T,), jnp.int32),
                  kv_segment_ids=jnp.zeros(bdims + (S,), jnp.int32),
                  alibi_slopes=jnp.ones((N,), jnp.float32))
    out, lse, (dq, dk, dv, db), _ = _run(impl, q, k, v, bias, arrays, is_causal=True,
                                         local_window_size=(2, 1), softcap=5.0)
    assert out.shape == bdims + (T, N, Hv) and out.dtype == jnp.bfloat16
    assert lse.shape == bdims + (T, N) and lse.dtype == jnp.float32
    assert np.all(np.asarray(out, np.float32) == 0)  # S = 0: every row sees no key
    assert np.all(np.isneginf(np.asarray(lse)))
    for g, x in ((dq, q), (dk, k), (dv, v), (db, bias)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert np.all(np.asarray(g, np.float32) == 0)


def test_empty_call_under_jit_and_vmap():
    q = _rand((3, 2, 4, 8), 1)
    k = _rand((3, 0, 4, 8), 2)
    f = jax.jit(jax.vmap(lambda q, k: jaxflash.flash_attention(q, k, k, implementation="xla")))
    out = f(q, k)
    assert out.shape == (3, 2, 4, 8) and not np.any(np.asarray(out))


@pytest.mark.parametrize("impl", ["xla", "pallas", "cute"])
def test_vmap_over_an_empty_axis(impl):
    """Empty outputs and gradients; a named backend must still serve the configuration (cute
    does not on the CPU: NotImplementedError, as for any of its calls here)."""
    q = jnp.ones((0, 1, 4, 2, 16))
    f = lambda q: jaxflash.flash_attention(q, q, q, is_causal=True, implementation=impl)
    if impl == "cute" and jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError):
            jax.vmap(f)(q)
        return
    out = jax.vmap(f)(q)
    assert out.shape == q.shape
    g = jax.grad(lambda q: jnp.sum(jax.vmap(f)(q)))(q)
    assert g.shape == q.shape


def test_bridge_vmap_over_an_empty_axis_launches_nothing(monkeypatch):
    """The CuTe bridge (self-test kernel, a fake binary, lowered for CUDA): a size-0 vmap axis
    folds into an empty batch, which must not reach a kernel launch."""
    import hashlib

    from jaxflash.ffi import cache
    from jaxflash.kernels.variants.selftest import scale_add
    monkeypatch.setattr(cache, "get_binary", lambda launch: cache.Binary(
        b"fake", hashlib.sha256(b"fake").digest(), "memory"))
    f = jax.vmap(lambda a: scale_add(a, a, 2.0, arch="sm_90a"))
    low = jax.jit(f).trace(jnp.ones((0, 3, 4))).lower(lowering_platforms=("cuda",))
    assert "custom_call" not in low.as_text()
    assert jax.eval_shape(f, jnp.ones((0, 3, 4))).shape == (0, 3, 4)


def test_empty_call_still_checks_the_named_backend():
    """Empty or not, a named backend that cannot serve the configuration refuses it."""
    q = jnp.zeros((0, 4, 2, 512))
    with pytest.raises(NotImplementedError, match="head_dim 512"):
        jaxflash.flash_attention(q, q, q, implementation="pallas")
    with pytest.raises(NotImplementedError, match="CUDA only"):  # on this CPU-only machine
        jaxflash.flash_attention(q, q, q, implementation="cute")
    with pytest.raises(NotImplementedError, match="CUDA only"):
        jaxflash.flash_attention(jnp.zeros((1, 3, 2, 64)), jnp.zeros((1, 0, 2, 64)),
                                 jnp.zeros((1, 0, 2, 64)), implementation="cute")


@pytest.mark.parametrize("shape_q,shape_k", [((0, 128, 4, 64), (0, 128, 4, 64)),
                                             ((2, 128, 4, 64), (2, 0, 4, 64)),
                                             ((2, 0, 4, 64), (2, 128, 4, 64))],
                         ids=["B=0", "S=0", "T=0"])
def test_empty_call_for_cuda_launches_no_kernel(shape_q, shape_k):
    """Lowered for CUDA (the CuTe backend's platform) an empty call holds no custom call: no
    kernel ever sees a zero-sized grid; `explain` says so."""
    q = jnp.zeros(shape_q, jnp.bfloat16)
    k = jnp.zeros(shape_k, jnp.bfloat16)
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, k, k)
        assert "empty call" in str(plan) and "nothing is launched" in str(plan)
        for impl in (None, "cute"):
            f = functools.partial(jaxflash.flash_attention, implementation=impl)
            try:
                low = jax.jit(f).trace(q, k, k).lower(lowering_platforms=("cuda",))
            except NotImplementedError as e:  # a named cute that cannot serve here says why
                assert impl == "cute" and "'cute' refused" in str(e)
                continue
            assert "custom_call" not in low.as_text()


def test_ring_attention_refuses_empty_calls_clearly():
    """ring_attention (whose per-block backends see every shape) keeps the ValueError."""
    q = jnp.zeros((2, 0, 2, 8))
    with pytest.raises(ValueError, match="must be positive for this entry point"):
        jaxflash.ring_attention(q, q, q, mesh=None, seq_axis="x")


@pytest.mark.parametrize("dims", [(0, 0, 8, 8), (2, 2, 0, 8), (2, 2, 8, 0)],
                         ids=["N=K=0", "H=0", "Hv=0"])
def test_zero_heads_or_head_dims_are_value_errors(dims):
    N, K, H, Hv = dims
    with pytest.raises(ValueError, match="must be positive"):
        jaxflash.flash_attention(jnp.zeros((1, 3, N, H)), jnp.zeros((1, 3, K, H)),
                                 jnp.zeros((1, 3, K, Hv)))


# ------------------------------------------------------------------------ tiny, but not empty
_SMALL = [  # (id, B, T, S, N, K, kwargs, q_lens, kv_lens)
    ("T=S=1,N=K=1,len0", 2, 1, 1, 1, 1, {}, None, (1, 0)),
    ("T=1,S=7,causal", 2, 1, 7, 2, 1, {"is_causal": True}, None, (7, 3)),
    ("T=7,S=1,causal,window,qlen", 2, 7, 1, 2, 1,
     {"is_causal": True, "local_window_size": (1, 0)}, (7, 4), None),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,T,S,N,K,kwargs,q_lens,kv_lens", [c[1:] for c in _SMALL],
                         ids=[c[0] for c in _SMALL])
def test_small_shapes_match_float64_model(impl, B, T, S, N, K, kwargs, q_lens, kv_lens):
    H = 16
    q, k, v = _rand((B, T, N, H), 1), _rand((B, S, K, H), 2), _rand((B, S, K, H), 3)
    arrays = {}
    if q_lens is not None:
        arrays["query_seq_lengths"] = jnp.asarray(q_lens, jnp.int32)
    if kv_lens is not None:
        arrays["key_value_seq_lengths"] = jnp.asarray(kv_lens, jnp.int32)
    out, lse, (dq, dk, dv), w = _run(impl, q, k, v, None, arrays, **kwargs)
    ref_out, ref_lse, (rdq, rdk, rdv, _) = npref.attention(
        q, k, v, is_causal=kwargs.get("is_causal", False),
        window=kwargs.get("local_window_size"), q_lens=q_lens, kv_lens=kv_lens,
        dout=np.asarray(w))
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=2e-5, atol=2e-5)
    for name, g, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_transposed_sliced_and_broadcast_inputs(impl):
    """Inside one jitted program (where XLA could otherwise keep them as layouts, strides or
    broadcasts): a transposed q, a strided slice of v, k and bias broadcast with
    `jnp.broadcast_to`, a slice of a longer k/v: the same result as contiguous inputs."""
    B, T, S, N, K, H = 2, 5, 9, 3, 3, 16
    q_bnth = _rand((B, N, T, H), 1)
    k1 = _rand((1, S + 4, K, H), 2)
    v_wide = _rand((B, S, K, 2 * H), 3)
    bias1 = _rand((1, 1, T, S), 4)

    @jax.jit
    def f(q_bnth, k1, v_wide, bias1):
        q = jnp.swapaxes(q_bnth, 1, 2)  # [B, T, N, H] from a [B, N, T, H] array
        k = jnp.broadcast_to(k1[:, 2:S + 2], (B, S, K, H))
        v = v_wide[..., ::2]
        bias = jnp.broadcast_to(bias1, (B, N, T, S))
        return jaxflash.flash_attention(q, k, v, bias, local_window_size=(2, 1),
                                        implementation=impl)

    out = f(q_bnth, k1, v_wide, bias1)
    k = np.broadcast_to(np.asarray(k1)[:, 2:S + 2], (B, S, K, H))
    ref, _ = npref.attention(np.swapaxes(np.asarray(q_bnth), 1, 2), k,
                             np.asarray(v_wide)[..., ::2],
                             np.broadcast_to(np.asarray(bias1), (B, N, T, S)), window=(2, 1))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------ head dims not served
@pytest.mark.parametrize("H,Hv,cute_why", [(40, 40, "head dim 40"), (512, 512, "head dim 512"),
                                           (128, 64, "value head dim 64 != head dim 128")])
def test_unserved_head_dims_fall_back_with_a_reason(H, Hv, cute_why):
    q = jax.ShapeDtypeStruct((2, 128, 4, H), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 128, 4, Hv), jnp.bfloat16)
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, q, v)
    refused = dict(plan.refused)
    assert cute_why in refused["cute"], str(plan)
    assert plan.backend != "cute", str(plan)
    if max(H, Hv) > 256:
        assert "head_dim 512 > 256" in refused["pallas"], str(plan)
        assert plan.backend in ("cudnn", "xla"), str(plan)
    else:
        assert plan.backend in ("cudnn", "pallas"), str(plan)


def test_pallas_refuses_head_dims_over_256_by_name():
    x = jnp.zeros((1, 2, 1, 320))
    with pytest.raises(NotImplementedError, match="head_dim 320 > 256"):
        jaxflash.flash_attention(x, x, x, implementation="pallas")


def test_pallas_serves_odd_head_dims_and_hv_ne_h():
    """H = 40 (padded to 64 inside the kernel) with Hv = 24: served and correct."""
    q, k, v = _rand((1, 3, 2, 40), 1), _rand((1, 4, 2, 40), 2), _rand((1, 4, 2, 24), 3)
    out = jaxflash.flash_attention(q, k, v, implementation="pallas")
    ref, _ = npref.attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)
