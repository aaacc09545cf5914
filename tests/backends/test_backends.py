"""The shared backend test base: every backend against the float32 reference, on fresh random
inputs, forward (out, LSE) and gradients (q, k, v, bias, alibi_slopes).

Parametrized over backends: "pallas" (our kernels; interpret mode on CPU, which is how CI runs
them; sizes are small because interpret mode is slow), "cute" (GPU only) and "xla" (the
reference itself: the harness and the API plumbing). In float32 "xla" is compared with itself,
so it runs only where that is not a tautology: low-precision inputs (against the float32
upcast), the exact zeros / -inf of empty rows, and everything at once. Its semantics per feature
are checked in tests/api (against jax.nn and an independent NumPy model). The pallas tile sizes
in interpret mode are 16 x 32 (see `jaxflash.pallas_fallback.config`), so T = 17, 33, 45 ...
exercise several blocks and ragged tails. Each check is one jitted program (`_run`).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests.common import (FWD_TOL, GRAD_TOL, Case, assert_close, fresh_rng, oracle, randn,
                          split_kwargs)

KERNELS = ["pallas", pytest.param("cute", marks=pytest.mark.gpu)]
BACKENDS = ["xla"] + KERNELS


def _pairs(names, backends):
    """(name, backend) parameters, id "name-backend", keeping the backends' marks."""
    out = []
    for n in names:
        for b in backends:
            value, marks = (b.values[0], b.marks) if hasattr(b, "values") else (b, ())
            out.append(pytest.param(n, value, marks=marks, id=f"{n}-{value}"))
    return out


def _grads(q, k, v, impl, kwargs, w):
    """d/d(q, k, v[, bias][, alibi_slopes]) of sum(out * w)."""
    kw = dict(kwargs)
    bias = kw.pop("bias", None)
    alibi = kw.pop("alibi_slopes", None)

    def f(q, k, v, bias, alibi):
        extra = {}
        if bias is not None:
            extra["bias"] = bias
        if alibi is not None:
            extra["alibi_slopes"] = alibi
        out = jaxflash.flash_attention(q, k, v, implementation=impl, **kw, **extra)
        return jnp.sum(out.astype(jnp.float32) * w)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if alibi is not None else ())
    return jax.grad(f, argnums=argnums)(q, k, v, bias, alibi)


# The CuTe kernels take bf16/fp16, head dims 64-256 and Hv = H; the shared cases are mostly
# float32 at H = 32 (cheap in interpret mode). For "cute" each case is run at the nearest shape it
# serves (same lengths, heads and features): float32 -> bfloat16, H < 64 -> 64, Hv -> H. Dense
# biases and boolean masks are outside its API: there the test checks the refusal instead.
def for_backend(case: Case, backend: str) -> Case:
    if backend != "cute":
        return case
    import dataclasses
    return dataclasses.replace(case, dtype="bfloat16" if case.dtype == "float32" else case.dtype,
                               H=max(case.H, 64), Hv=None)


def _cute_refuses(case: Case) -> bool:
    return case.bias or case.mask or "bias" in case.kwargs


def _run(backend, q, k, v, kwargs, w):
    """(out, lse), the reference's (out, lse), the backend's and the reference's gradients of
    sum(out * w): one jitted program (eagerly, every primitive compiles on its own: ~90 XLA
    compiles per case, 5x the time)."""
    arrays, statics = split_kwargs(kwargs)

    def run(q, k, v, w, arrays):
        kw = dict(statics, **arrays)
        out, lse = jaxflash.flash_attention(q, k, v, implementation=backend,
                                            return_residual=True, **kw)
        up = lambda x: x.astype(jnp.float32)
        return ((out, lse), oracle(q, k, v, **kw), _grads(q, k, v, backend, kw, w),
                _grads(up(q), up(k), up(v), "xla", kw, w))

    return jax.jit(run)(q, k, v, w, arrays)


def check_case(backend, case: Case, *, grads=True):
    """Forward, LSE and gradients of `backend` vs the reference on fresh inputs; returns the
    backend's (out, lse, gradients)."""
    case = for_backend(case, backend)
    if backend == "cute" and _cute_refuses(case):
        q, k, v, kwargs = case.make()
        with pytest.raises(NotImplementedError, match="bias|mask"):
            jaxflash.flash_attention(q, k, v, implementation=backend, **kwargs)
        pytest.skip("cute refuses dense bias / mask by design (refusal checked)")
    q, k, v, kwargs = case.make()
    w = randn(q.shape[:-1] + v.shape[-1:])
    (out, lse), (ref_out, ref_lse), got, ref = _run(backend, q, k, v, kwargs, w)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    ftol, gtol = FWD_TOL[case.dtype], GRAD_TOL[case.dtype]
    assert_close(out, ref_out, ftol, "out")
    assert_close(lse, ref_lse, 1e-5 if case.dtype == "float32" else ftol, "lse")
    if not grads:
        return out, lse, got
    names = ["dq", "dk", "dv"] + (["dbias"] if "bias" in kwargs else []) + (
        ["dalibi"] if "alibi_slopes" in kwargs else [])
    assert len(got) == len(ref) == len(names)
    for name, g, r in zip(names, got, ref):
        assert_close(g, r, gtol, name)
    return out, lse, got


def _slopes(n):
    return jnp.asarray(np.geomspace(0.5, 0.05, n), jnp.float32)


def _segments(B, L, rng):
    """Random sorted segment ids (packed documents) [B, L] int32."""
    cuts = rng.integers(0, 4, (B, L))
    return np.cumsum(cuts == 0, axis=1).astype(np.int32)


# ------------------------------------------------------------------ shapes and dtypes
SHAPES = {
    "odd17": Case(T=17, S=17),
    "T1": Case(T=1, S=17, N=4, K=2),
    "T_ne_S": Case(T=33, S=50),
    "gqa4": Case(T=20, S=35, N=8, K=2),
    "hv_ne_h": Case(T=18, S=21, H=32, Hv=64),
    "h96_padded": Case(T=17, S=19, N=2, K=1, H=96),
    "h64_bf16_gqa": Case(T=33, S=40, N=4, K=2, H=64, dtype="bfloat16"),
    "f16": Case(T=24, S=31, dtype="float16"),
}
# MQA (K = 1): h96_padded, test_long_causal, test_fully_masked_rows, test_combined (in bf16).


@pytest.mark.parametrize("name,backend", _pairs(SHAPES, KERNELS) + _pairs(
    [n for n, c in SHAPES.items() if c.dtype != "float32"], ["xla"]))
def test_shapes(backend, name):
    check_case(backend, SHAPES[name])


@pytest.mark.parametrize("backend", KERNELS)
def test_long_causal(backend):
    """One longer, ragged case: many blocks in both passes, causal block skipping."""
    check_case(backend, Case(B=1, T=300, S=270, N=2, K=1, H=32, kwargs=dict(is_causal=True)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_256(backend):
    check_case(backend, Case(B=1, T=20, S=20, N=2, K=1, H=256, dtype="bfloat16",
                             kwargs=dict(is_causal=True)))


# ------------------------------------------------------------------ each feature alone
def _features():
    rng = np.random.default_rng(11)  # (NumPy: import-time jax.random draws would compile)
    B, T, S, N = 2, 29, 37, 4
    return {
        "causal": Case(T=T, S=S, kwargs=dict(is_causal=True)),
        "causal_T_gt_S": Case(T=45, S=20, kwargs=dict(is_causal=True)),
        "window": Case(T=T, S=S, kwargs=dict(local_window_size=(6, 3))),
        "window_left_only": Case(T=40, S=40, kwargs=dict(local_window_size=(10, 0))),
        "softcap": Case(T=T, S=S, kwargs=dict(softcap=1.5)),
        "alibi": Case(T=T, S=S, kwargs=dict(alibi_slopes=_slopes(N))),
        "bias": Case(T=T, S=S, bias=True),
        "bias_heads_only": Case(T=T, S=S, kwargs=dict(
            bias=randn((1, N, T, S), rng=rng))),
        "bias_broadcast_ts": Case(T=T, S=S, kwargs=dict(
            bias=randn((B, 1, 1, S), rng=rng))),
        "mask": Case(T=T, S=S, mask=True),
        "segments": Case(T=T, S=S, kwargs=dict(q_segment_ids=_segments(B, T, rng),
                                               kv_segment_ids=_segments(B, S, rng))),
        "seq_lengths": Case(T=T, S=S, kwargs=dict(
            query_seq_lengths=jnp.array([T, 9], jnp.int32),
            key_value_seq_lengths=jnp.array([20, S], jnp.int32))),
    }


FEATURES = _features()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", list(FEATURES))
def test_feature(backend, name):
    check_case(backend, FEATURES[name])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_combined(backend):
    """Every feature at once, MQA, ragged T != S, bf16."""
    B, T, S, N = 2, 45, 38, 4
    rng = fresh_rng()
    seg_q = _segments(B, T, rng)
    seg_k = seg_q[:, :S]  # aligned documents, so most rows see something
    bias = randn((T, S), rng=rng, scale=0.5)  # broadcast over batch and heads
    case = Case(B=B, T=T, S=S, N=N, K=1, H=32, dtype="bfloat16", mask=True,
                kwargs=dict(bias=bias, is_causal=True, local_window_size=(12, 4), softcap=3.0,
                            alibi_slopes=_slopes(N), q_segment_ids=seg_q,
                            kv_segment_ids=seg_k,
                            key_value_seq_lengths=jnp.array([S, 30], jnp.int32)))
    check_case(backend, case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows(backend):
    """Rows with no visible key: out 0, LSE -inf, finite (zero) gradients for those rows."""
    T, S = 20, 24
    case = Case(T=T, S=S, N=2, K=1, kwargs=dict(
        key_value_seq_lengths=jnp.array([0, 12], jnp.int32),   # batch 0: every row empty
        local_window_size=(2, 1),                              # rows >= 14 of batch 1: empty
        query_seq_lengths=jnp.array([T, 15], jnp.int32)))
    out, lse, (gq, gk, gv) = check_case(backend, case)  # grads of sum(out * w), w random
    out, lse = np.asarray(out, np.float32), np.asarray(lse)  # public layouts: [B,T,N,*]
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(out[1, 14:] == 0) and np.all(np.isneginf(lse[1, 14:]))
    assert np.all(np.isfinite(lse[1, :14]))
    for g in (gq, gk, gv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(gq)[0] == 0) and np.all(np.asarray(gk)[0] == 0)


# ------------------------------------------------------------------ transformations
def _small():
    return Case(B=2, T=17, S=20, N=4, K=2, H=32).make()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas"])
def test_transformations(backend):
    """jit, vmap (extra leading batch dim mapped), grad, checkpoint and export around
    flash_attention all run and agree with the reference."""
    q, k, v, _ = _small()
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                 implementation=backend)
    ref_loss = lambda q, k, v: jnp.sum(jaxflash.flash_attention(
        q, k, v, is_causal=True, implementation="xla") ** 2)
    ref, rg = jax.jit(lambda q, k, v: (oracle(q, k, v, is_causal=True)[0],
                                       jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    assert_close(jax.jit(f)(q, k, v), ref, FWD_TOL["float32"], "jit")
    # (vmap inside jit: eagerly each primitive of the interpreted kernel compiles on its own)
    vm = jax.jit(lambda q, k, v: jax.vmap(f, in_axes=(1, 1, 1), out_axes=1)(
        q[:, None], k[:, None], v[:, None])[:, 0])(q, k, v)
    assert_close(vm, ref, FWD_TOL["float32"], "vmap")

    loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
    g = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    for a, b, n in zip(g, rg, "qkv"):
        assert_close(a, b, GRAD_TOL["float32"], f"checkpoint d{n}")

    exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    eg = exp.call(q, k, v)
    for a, b, n in zip(eg, rg, "qkv"):
        assert_close(a, b, GRAD_TOL["float32"], f"export d{n}")


# ------------------------------------------------------------------ memory: no T x S buffer
def _shapes_in(text):
    import re
    return [tuple(int(d) for d in m.split("x") if d)
            for m in re.findall(r"tensor<((?:\d+x)+)[a-z]", text)]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_backward_has_no_t_by_s_buffer(platform):
    """The lowered forward+backward holds no buffer of T x S (or a multiple) elements: checked
    on the interpret-mode lowering (CPU) and the Triton lowering (CUDA, lowered here without a
    GPU). T=40, S=56: T*S = 2240 divides no other operand's size here."""
    B, T, S, N, H = 2, 40, 56, 4, 32
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    k = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32)

    def loss(q, k, v, slopes):
        return jnp.sum(jaxflash.flash_attention(q, k, v, is_causal=True, softcap=5.0,
                                                alibi_slopes=slopes, implementation="pallas"))

    slopes = jax.ShapeDtypeStruct((N,), jnp.float32)
    with jaxflash.target_platform(platform):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, k, slopes).lower(
            lowering_platforms=(platform,)).as_text()
    marker = "xla.gpu.triton" if platform == "cuda" else "stablehlo.while"  # interpreted grid
    assert marker in text, "pallas kernels not lowered"
    bad = [s for s in _shapes_in(text) if int(np.prod(s)) % (T * S) == 0]
    assert not bad, f"T x S sized buffers in the lowered backward: {bad[:5]}"
    # Sanity: the same check does see the reference's T x S logits.
    ref_text = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxflash.flash_attention(
        q, k, v, implementation="xla")), argnums=(0, 1, 2))).trace(q, k, k).lower().as_text()
    assert any(int(np.prod(s)) % (T * S) == 0 for s in _shapes_in(ref_text))
