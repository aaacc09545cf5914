"""The ``cudnn`` backend on a CUDA GPU (the H200): forward, LSE and gradients against the float32
reference on fresh random inputs, jaxflash's semantics on fully masked rows (output 0, LSE
-inf, finite and zero gradients), the backward on a given (out, lse) as ring attention hands
it, and `explain` choosing cuDNN for calls `cute` refuses. Skipped without a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import dispatch
from jaxflash._types import AttentionArrays, AttentionStatics, Problem
from tests.common import FWD_TOL, GRAD_TOL, Case, assert_close, fresh_key

pytestmark = pytest.mark.gpu

L = lambda *xs: jnp.array(xs, jnp.int32)  # noqa: E731

CASES = {
    "bf16_h64": Case(T=256, S=256, N=4, K=4, H=64, dtype="bfloat16"),
    "fp16_h128_causal": Case(T=200, S=200, H=128, dtype="float16", kwargs={"is_causal": True}),
    "odd_gqa": Case(T=97, S=131, N=8, K=2, H=64, dtype="bfloat16"),
    "mqa_causal_t<s": Case(T=64, S=160, N=4, K=1, H=128, dtype="bfloat16",
                           kwargs={"is_causal": True}),
    "causal_t>s": Case(T=160, S=64, H=64, dtype="float16", kwargs={"is_causal": True}),
    "window_causal_t<s": Case(T=100, S=150, H=64, dtype="bfloat16",
                              kwargs={"is_causal": True, "local_window_size": (16, 4)}),
    "window_left_only": Case(T=96, S=128, H=64, dtype="bfloat16",
                             kwargs={"local_window_size": (20, 0)}),
    # A window that removes nothing is dropped (cuDNN refuses windows with T > S).
    "window_noop_t>s": Case(T=160, S=64, H=64, dtype="bfloat16",
                            kwargs={"is_causal": True, "local_window_size": (200, 0)}),
    "lengths_empty_rows": Case(B=3, T=128, S=96, H=64, dtype="bfloat16",
                               kwargs={"is_causal": True,
                                       "query_seq_lengths": L(128, 50, 0),
                                       "key_value_seq_lengths": L(96, 0, 40)}),
    "lengths_window": Case(B=2, T=128, S=128, N=4, K=2, H=128, dtype="float16",
                           kwargs={"is_causal": True, "local_window_size": (32, 0),
                                   "key_value_seq_lengths": L(128, 77)}),
    "bias": Case(T=128, S=192, H=64, dtype="bfloat16", bias=True),
    "bias_causal_fp16": Case(T=96, S=96, H=128, dtype="float16", bias=True,
                             kwargs={"is_causal": True}),
    "mask_lengths": Case(B=2, T=64, S=128, H=64, dtype="bfloat16", mask=True,
                         kwargs={"query_seq_lengths": L(64, 40)}),
    "bias_mask_lengths_gqa": Case(B=2, T=64, S=96, N=4, K=2, H=64, dtype="bfloat16", bias=True,
                                  mask=True, kwargs={"key_value_seq_lengths": L(96, 33)}),
    "h80": Case(T=128, S=128, H=80, dtype="bfloat16", kwargs={"is_causal": True}),
    "h256": Case(T=128, S=128, H=256, dtype="bfloat16", kwargs={"is_causal": True}),
    "mla_192_128": Case(T=128, S=128, H=192, Hv=128, dtype="bfloat16",
                        kwargs={"is_causal": True}),
}


def _inputs(case):
    q, k, v, kw = case.make()
    if "mask" in kw:  # one query row with every key masked out
        kw["mask"] = kw["mask"].at[:, :, 3, :].set(False)
    return q, k, v, kw


def _loss_fn(kw, w):
    kw = dict(kw)
    has_bias = "bias" in kw
    kw.pop("bias", None)

    def loss(q, k, v, bias, impl):
        out, lse = jaxflash.flash_attention(q, k, v, bias=bias if has_bias else None,
                                            implementation=impl, return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    argnums = (0, 1, 2) + ((3,) if has_bias else ())
    return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True), static_argnums=4)


@pytest.mark.parametrize("name", list(CASES))
def test_cudnn_matches_reference_and_semantics(name):
    case = CASES[name]
    q, k, v, kw = _inputs(case)
    w = jax.random.normal(fresh_key(), q.shape[:-1] + (v.shape[-1],), jnp.float32)
    run = _loss_fn(kw, w)
    bias = kw.get("bias")
    d = jaxflash.explain(q, k, v, implementation="cudnn", **kw)
    assert d.backend == "cudnn", str(d)
    grads, (out, lse) = run(q, k, v, bias, "cudnn")
    up = lambda x: x.astype(jnp.float32)
    rgrads, (rout, rlse) = run(up(q), up(k), up(v), bias, "xla")
    dt = case.dtype
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, rout, FWD_TOL[dt], f"{name} out")
    assert_close(lse, rlse, FWD_TOL[dt], f"{name} lse")  # -inf rows must match exactly
    empty = np.isneginf(np.asarray(rlse))  # [B, T, N]
    assert np.all(np.asarray(out, np.float32)[empty] == 0), f"{name}: fully masked rows != 0"
    names = ["dq", "dk", "dv", "dbias"]
    for i, (g, r) in enumerate(zip(grads, rgrads)):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{name} {names[i]} not finite"
        assert_close(g, r, GRAD_TOL[dt], f"{name} {names[i]}")
    assert np.all(np.asarray(grads[0], np.float32)[empty] == 0), f"{name}: dq of empty rows"


def test_cudnn_bias_gradient_over_broadcast_dims_with_lengths():
    """A [1, 1, T, S] bias with sequence lengths: dbias summed over batch and heads, and
    nothing from past the lengths."""
    case = Case(B=3, T=64, S=96, N=4, K=2, H=64, dtype="bfloat16",
                kwargs={"query_seq_lengths": L(64, 20, 64),
                        "key_value_seq_lengths": L(96, 50, 0)})
    q, k, v, kw = case.make()
    bias = jax.random.normal(fresh_key(), (1, 1, 64, 96)) * 0.5
    w = jax.random.normal(fresh_key(), q.shape, jnp.float32)

    def grad(impl, q, k, v):
        def loss(b):
            out = jaxflash.flash_attention(q, k, v, bias=b, implementation=impl, **kw)
            return jnp.sum(out.astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss))(bias)

    got = grad("cudnn", q, k, v)
    up = lambda x: x.astype(jnp.float32)
    want = grad("xla", up(q), up(k), up(v))
    assert got.shape == bias.shape
    assert_close(got, want, GRAD_TOL["bfloat16"], "dbias")


def test_cudnn_backward_honours_the_given_out_and_lse():
    """Ring attention's contract: each key block's backward on the merged (out, lse) of all
    blocks; their sum is the whole call's gradient (checked with uneven blocks, causal)."""
    from jaxflash.ring import _merge
    B, T, S, N, H = 2, 128, 128, 4, 64
    q, k, v, _ = Case(B=B, T=T, S=S, N=N, K=N, H=H, dtype="bfloat16").make()
    backend = dispatch.get_backend("cudnn")
    # Non-causal: a causal split of the keys would need per-block position offsets.
    blocks = [slice(0, 48), slice(48, S)]
    statics = AttentionStatics(scale=H ** -0.5)
    dout = jax.random.normal(fresh_key(), (B, T, N, H)).astype(q.dtype)
    arr = AttentionArrays()

    @jax.jit
    def blockwise(q, k, v, dout):
        out = jnp.zeros((B, T, N, H), jnp.float32)
        lse = jnp.full((B, N, T), -jnp.inf)
        plans = []
        for sl in blocks:
            problem = Problem.from_arrays(q, k[:, sl], v[:, sl], arr, statics, "cuda")
            _, plan = dispatch.select(problem, "cudnn")
            ob, lb = backend.forward(q, k[:, sl], v[:, sl], arr, statics, plan)
            out, lse = _merge(out, lse, ob, lb)
            plans.append(plan)
        out = out.astype(q.dtype)
        dq, dks, dvs = 0.0, [], []
        for sl, plan in zip(blocks, plans):
            g = backend.backward(q, k[:, sl], v[:, sl], arr, statics, plan, out, lse, dout)
            dq = dq + g[0].astype(jnp.float32)
            dks.append(g[1])
            dvs.append(g[2])
        return out, lse, dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)

    out, lse, dq, dk, dv = blockwise(q, k, v, dout)
    up = lambda x: x.astype(jnp.float32)

    @jax.jit
    def ref(q, k, v, d):
        f = lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="xla",
                                                     return_residual=True)
        (o, l), vjp = jax.vjp(f, q, k, v)
        return o, l, vjp((d, jnp.zeros_like(l)))

    ro, rl, (rq, rk, rv) = ref(up(q), up(k), up(v), up(dout))
    assert_close(out, ro, FWD_TOL["bfloat16"], "merged out")
    assert_close(jnp.swapaxes(lse, 1, 2), rl, FWD_TOL["bfloat16"], "merged lse")
    tol = GRAD_TOL["bfloat16"]
    assert_close(dq, rq, tol, "dq")
    assert_close(dk, rk, tol, "dk")
    assert_close(dv, rv, tol, "dv")


def test_cudnn_under_vmap():
    """vmap over a leading axis (JAX's cuDNN batching rule takes batch dim 0 only)."""
    case = Case(T=64, S=64, H=64, dtype="bfloat16", kwargs={"is_causal": True})
    q, k, v, kw = case.make()
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="cudnn", **kw)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    vm = jax.jit(jax.vmap(grad))(q[None], k[None], v[None])
    want = jax.jit(grad)(q, k, v)
    for i in range(3):
        assert_close(vm[i][0], want[i], 1e-2, f"vmap(grad) {'qkv'[i]}")


# ------------------------------------------------------------------ dispatch on the GPU
def _sds(T=256, S=256, N=8, K=8, H=64, Hv=None, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((2, T, N, H), dtype), jax.ShapeDtypeStruct((2, S, K, H), dtype),
            jax.ShapeDtypeStruct((2, S, K, Hv or H), dtype))


@pytest.mark.parametrize("what", ["head_dim_80", "bias", "hv_ne_h"])
def test_explain_chooses_cudnn_when_cute_refuses(what):
    from jaxflash.backends import cudnn
    env = cudnn._env()
    assert env.cc is not None and env.cc >= (9, 0) and env.cudnn >= 90000, env
    if what == "head_dim_80":
        d = jaxflash.explain(*_sds(H=80), is_causal=True)
    elif what == "bias":
        d = jaxflash.explain(*_sds(H=128), bias=jax.ShapeDtypeStruct((1, 8, 256, 256),
                                                                     jnp.float32))
    else:
        d = jaxflash.explain(*_sds(H=192, Hv=128), is_causal=True)
    text = str(d)
    print(text)
    assert d.platform in ("cuda", "gpu")
    assert d.backend == "cudnn", text
    assert dict(d.refused).get("cute"), text  # cute refused it, and said why
    assert "cuDNN fused attention on sm_90" in text, text


def test_explain_reports_what_cudnn_refuses_on_the_gpu():
    d = jaxflash.explain(*_sds(H=80), softcap=20.0)
    assert d.backend == "pallas" and "softcap" in dict(d.refused)["cudnn"], str(d)
    d = jaxflash.explain(*_sds(T=128, S=64, H=80), is_causal=True, local_window_size=(8, 0))
    assert d.backend == "pallas" and "T <= S" in dict(d.refused)["cudnn"], str(d)
    d = jaxflash.explain(*_sds(H=80, dtype=jnp.float32))
    assert "float16 / bfloat16" in dict(d.refused)["cudnn"], str(d)

