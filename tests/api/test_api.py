"""The public API: argument validation, parity with jax.nn.dot_product_attention, dispatch."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests.common import (Case, assert_close, bernoulli, oracle, randint, randn,
                          split_kwargs)


def _qkv(B=2, T=5, S=7, N=4, K=2, H=8, Hv=None, dtype=jnp.float32):
    return randn((B, T, N, H), dtype), randn((B, S, K, H), dtype), randn((B, S, K, Hv or H), dtype)


# ---------------------------------------------------------------- every ValueError path
def _bad_calls():
    q, k, v = _qkv()
    i32 = lambda *s: jnp.zeros(s, jnp.int32)
    return [
        ("rank", dict(query=q[0, 0], key=k[0, 0], value=v[0, 0]), "at least 3 dims"),
        ("rank mismatch", dict(query=q, key=k[0], value=v), "same rank"),
        ("int dtype", dict(query=q.astype(jnp.int32), key=k, value=v), "dtype must be"),
        ("mixed dtype", dict(query=q, key=k.astype(jnp.bfloat16), value=v), "share a dtype"),
        ("batch", dict(query=q, key=k[:1], value=v[:1]), "batch dims"),
        ("kv seq", dict(query=q, key=k, value=v[:, :3]), "sequence lengths differ"),
        ("kv heads", dict(query=q, key=k, value=v[:, :, :1]), "head counts differ"),
        ("head dim", dict(query=q, key=k[..., :4], value=v), "head dims differ"),
        ("heads divide", dict(query=q[:, :, :3], key=k, value=v), "multiple of key/value heads"),
        ("zero head dim", dict(query=q[..., :0], key=k[..., :0], value=v), "positive"),
        ("zero heads", dict(query=q[:, :, :0], key=k, value=v), "positive"),
        ("scale", dict(query=q, key=k, value=v, scale=float("nan")), "scale"),
        ("softcap neg", dict(query=q, key=k, value=v, softcap=-1.0), "softcap"),
        ("softcap zero", dict(query=q, key=k, value=v, softcap=0.0), "softcap"),
        ("window type", dict(query=q, key=k, value=v, local_window_size=(1, 2, 3)), "pair"),
        ("bias shape", dict(query=q, key=k, value=v, bias=jnp.zeros((2, 4, 5, 6))), "broadcast"),
        ("bias rank", dict(query=q, key=k, value=v, bias=jnp.zeros((1, 2, 4, 5, 7))), "more dims"),
        ("mask dtype", dict(query=q, key=k, value=v, mask=jnp.ones((2, 4, 5, 7))), "boolean"),
        ("mask shape", dict(query=q, key=k, value=v, mask=jnp.ones((3, 1, 5, 7), bool)),
         "broadcast"),
        ("qlen shape", dict(query=q, key=k, value=v, query_seq_lengths=i32(3)), "shape"),
        ("qlen dtype", dict(query=q, key=k, value=v,
                            query_seq_lengths=jnp.zeros((2,), jnp.float32)), "int32"),
        ("kvlen shape", dict(query=q, key=k, value=v, key_value_seq_lengths=i32(2, 1)), "shape"),
        ("alibi shape", dict(query=q, key=k, value=v, alibi_slopes=jnp.ones((2,))), "alibi"),
        ("alibi dtype", dict(query=q, key=k, value=v, alibi_slopes=i32(4)), "floating"),
        ("seg alone", dict(query=q, key=k, value=v, q_segment_ids=i32(2, 5)), "together"),
        ("seg shape", dict(query=q, key=k, value=v, q_segment_ids=i32(2, 5),
                           kv_segment_ids=i32(2, 5)), "kv_segment_ids"),
        ("seg dtype", dict(query=q, key=k, value=v, q_segment_ids=jnp.zeros((2, 5)),
                           kv_segment_ids=i32(2, 7)), "int32"),
        ("implementation", dict(query=q, key=k, value=v, implementation="nope"),
         "implementation"),
    ]


@pytest.mark.parametrize("name,kwargs,msg", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_value_errors(name, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        jaxflash.flash_attention(**kwargs)


def test_shape_errors_name_the_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\(2, 5, 3, 8\)"):
        jaxflash.flash_attention(q[:, :, :3], k, v)


# ---------------------------------------------------------------- parity with jax.nn
_PARITY = [
    {},
    {"is_causal": True},
    {"local_window_size": 2},
    {"local_window_size": (3, 0), "is_causal": True},
    {"scale": 0.3},
    {"query_seq_lengths": [3, 5], "key_value_seq_lengths": [7, 2]},
    {"bias": True},
    {"mask": True},
]


@pytest.mark.parametrize("kw", _PARITY, ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize("gqa", [1, 2])
def test_matches_jax_nn_xla(kw, gqa):
    q, k, v = _qkv(K=4 // gqa)
    kw = dict(kw)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.array(kw[name], jnp.int32)
    if kw.pop("bias", False):
        kw["bias"] = randn((2, 4, 5, 7))
    if kw.pop("mask", False):
        # Keep at least one key per row: jax.nn and jaxflash differ (by design) on empty rows.
        m = np.array(bernoulli(0.6, (2, 1, 5, 7)))
        m[..., 0] = True
        kw["mask"] = jnp.asarray(m)
    arrays, statics = split_kwargs(kw)

    @jax.jit  # one program for both (eagerly every primitive compiles on its own)
    def both(q, k, v, arrays):
        kw = dict(statics, **arrays)
        return (jaxflash.flash_attention(q, k, v, implementation="xla", return_residual=True,
                                         **kw),
                jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                             return_residual=True, **kw))

    (ours, lse), (theirs, lse_ref) = both(q, k, v, arrays)
    if "query_seq_lengths" in kw:
        # jax.nn keeps a finite LSE for padded query rows; ours is -inf there (no key visible).
        valid = np.arange(5)[None, :] < np.asarray(kw["query_seq_lengths"])[:, None]
        lse, lse_ref = np.asarray(lse)[valid], np.asarray(lse_ref)[valid]
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=2e-5, atol=2e-5)


def test_three_dim_and_many_batch_dims():
    q, k, v = _qkv(B=6)
    rs = lambda x: x.reshape((2, 3) + x.shape[1:])  # (on NumPy results: eagerly, it compiles)
    seg_q, seg_k = randint(0, 2, (6, 5)), randint(0, 2, (6, 7))
    bias = randn((6, 1, 5, 7))

    @jax.jit  # one program for all five calls
    def calls(q, k, v, seg_q, seg_k, bias):
        attn = functools.partial(jaxflash.flash_attention, implementation="xla")
        return (attn(q, k, v, is_causal=True),
                # [T, N, H]: no batch dim at all.
                attn(q[0], k[0], v[0], is_causal=True),
                # [2, 3, T, N, H]: two leading batch dims, with per-batch segment ids and bias.
                attn(rs(q), rs(k), rs(v), is_causal=True),
                attn(q, k, v, bias, q_segment_ids=seg_q, kv_segment_ids=seg_k),
                attn(rs(q), rs(k), rs(v), rs(bias), q_segment_ids=rs(seg_q),
                     kv_segment_ids=rs(seg_k)))

    ref, out3, out5, a, b = map(np.asarray, calls(q, k, v, seg_q, seg_k, bias))
    np.testing.assert_allclose(out3, ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out5, rs(ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b, rs(a), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- semantics of the additions
def _dense_reference_np(q, k, v, *, scale, softcap=None, alibi=None, bias=None, keep=None):
    """An independent float64 numpy reference (does not share code with jaxflash.reference)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1:3]
    G = N // K
    kk = np.repeat(k, G, axis=2)
    vv = np.repeat(v, G, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, kk) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi is not None:
        i = np.arange(T)[:, None]
        j = np.arange(S)[None, :]
        s = s - np.asarray(alibi, np.float64)[None, :, None, None] * np.abs(i - j)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p / np.where(l == 0, 1, l), vv)
    lse = np.where(l[..., 0] == 0, -np.inf, (m + np.log(np.where(l == 0, 1, l)))[..., 0])
    return out, lse.transpose(0, 2, 1)


def test_additions_against_independent_numpy():
    B, T, S, N, K, H = 2, 9, 11, 4, 2, 16
    q, k, v = _qkv(B, T, S, N, K, H, Hv=8)
    alibi = jnp.array([0.5, 0.25, 0.125, 0.0625])
    bias = randn((B, 1, T, S))
    seg_q = jnp.asarray(np.sort(np.random.randint(0, 3, (B, T)), axis=1), jnp.int32)
    seg_k = jnp.asarray(np.sort(np.random.randint(0, 3, (B, S)), axis=1), jnp.int32)
    out, lse = jax.jit(functools.partial(
        jaxflash.flash_attention, softcap=2.5, is_causal=True, scale=0.3, implementation="xla",
        return_residual=True))(q, k, v, bias, alibi_slopes=alibi, q_segment_ids=seg_q,
                               kv_segment_ids=seg_k)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    keep = (j <= i)[None, None] & (np.asarray(seg_q)[:, None, :, None]
                                   == np.asarray(seg_k)[:, None, None, :])
    ref, ref_lse = _dense_reference_np(q, k, v, scale=0.3, softcap=2.5, alibi=alibi, bias=bias,
                                       keep=keep)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_zero_output_finite_grad():
    q, k, v = _qkv()
    mask = np.ones((2, 1, 5, 7), bool)
    mask[:, :, 2] = False
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, mask=mask, implementation="xla",
                                                 return_residual=True)
    (out, lse), grads = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(
        lambda *a: jnp.sum(f(*a)[0] ** 2), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    out, lse, grads = np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]
    assert np.all(out[:, 2] == 0)
    assert np.all(np.isneginf(lse[:, 2]))
    assert np.all(np.isfinite(lse[:, [0, 1, 3, 4]]))
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.all(grads[0][:, 2] == 0)


def test_lse_is_float32_and_stops_gradient():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out, lse = jax.jit(functools.partial(jaxflash.flash_attention, return_residual=True,
                                         implementation="xla"))(q, k, v)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32 and lse.shape == (2, 5, 4)
    g = jax.jit(jax.grad(lambda q: jnp.sum(jaxflash.flash_attention(
        q, k, v, return_residual=True, implementation="xla")[1])))(q)
    assert np.all(np.asarray(g, np.float32) == 0)


def test_bias_and_alibi_gradients_are_returned():
    q, k, v = _qkv()
    bias = randn((1, 4, 5, 7))
    alibi = np.array([0.1, 0.2, 0.3, 0.4], np.float32)

    @jax.jit
    def loss(bias, alibi):
        return jnp.sum(jaxflash.flash_attention(q, k, v, bias, alibi_slopes=alibi,
                                                implementation="xla") ** 2)

    db, da = jax.jit(jax.grad(loss, argnums=(0, 1)))(bias, alibi)
    assert db.shape == bias.shape and da.shape == alibi.shape
    # Check against finite differences on one alibi slope (float32: loose but meaningful; a
    # central difference's truncation error is O(eps^2), its float32 rounding O(1 / eps), so
    # a wider step is the steadier one on fresh inputs).
    eps = 1e-2
    e = np.zeros(4, np.float32)
    e[1] = eps
    fd = (float(loss(bias, alibi + e)) - float(loss(bias, alibi - e))) / (2 * eps)
    np.testing.assert_allclose(np.asarray(da)[1], fd, rtol=2e-2, atol=1e-3)
    assert np.abs(np.asarray(db)).sum() > 0


# ---------------------------------------------------------------- dispatch and explain
def test_explain_names_choice_and_refusals():
    q, k, v = _qkv()
    d = jaxflash.explain(q, k, v, is_causal=True)
    assert d.backend == "xla"  # CPU: XLA is the best available
    text = str(d)
    assert "'xla' runs" in text and "'cute' refused" in text and "'pallas' refused" in text
    # Shapes only: explain never needs the arrays' values.
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    assert jaxflash.explain(*sds).backend == "xla"
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(q, k, v)
    assert d.platform == "cuda" and d.backend is not None
    # On CUDA the preference order puts our kernels first: whatever runs, anything ahead of it
    # in that order must have been refused with a reason.
    order = ["cute", "pallas", "xla"]
    refused = dict(d.refused)
    for name in order[:order.index(d.backend)]:
        assert refused.get(name), f"{name} skipped without a reason"


def test_named_backend_that_cannot_serve_raises_not_implemented():
    q, k, v = _qkv()
    with jaxflash.target_platform("cpu"):
        d = jaxflash.explain(q, k, v, implementation="cute")
    if d.backend is None:
        with pytest.raises(NotImplementedError, match="cute"):
            jaxflash.flash_attention(q, k, v, implementation="cute")


def test_explain_validates_like_the_call():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softcap"):
        jaxflash.explain(q, k, v, softcap=-2.0)
    with pytest.raises(TypeError, match="is_casual"):  # a misspelt keyword is not ignored
        jaxflash.explain(q, k, v, is_casual=True)


def test_inputs_jax_nn_accepts():
    """What jax.nn.dot_product_attention takes, jaxflash takes: NumPy float64 (float32 without
    x64), a scale given as a 0-d array, a 4-D bias / mask with 3-D (batchless) inputs. A traced
    softcap is refused with the reason (it is compiled into the kernels); a traced scale is
    folded into the query (test_what_jax_nn_accepts_runs_as_it_does)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((7, 2, 8)) for _ in range(3))   # float64, [T, N, H]
    bias = rng.standard_normal((1, 2, 7, 7)).astype(np.float32)
    mask = rng.random((1, 1, 7, 7)) < 0.8
    mask[..., 0] = True
    kw = dict(bias=bias, mask=mask, scale=jnp.float32(0.3), implementation="xla")
    want = jax.nn.dot_product_attention(q, k, v, **kw)
    got = jaxflash.flash_attention(q, k, v, **kw)
    assert got.dtype == jnp.float32
    assert_close(got, want, 1e-5, "drop-in")
    with pytest.raises(ValueError, match="concrete"):
        jax.jit(lambda s: jaxflash.flash_attention(q, k, v, softcap=s))(3.0)


def test_second_order_gradients():
    """grad of grad: the XLA backend differentiates twice; a kernel backend says it cannot."""
    q, k, v = _qkv()
    for impl in ("xla", "pallas"):
        f = lambda q: jnp.sum(jaxflash.flash_attention(q, k, v, implementation=impl) ** 2)
        gg = lambda q: jnp.sum(jax.grad(f)(q) ** 2)
        if impl == "xla":
            assert np.all(np.isfinite(np.asarray(jax.jit(jax.grad(gg))(q))))
        else:
            with pytest.raises(NotImplementedError, match="second-order"):
                jax.jit(jax.grad(gg))(q)


# ---------------------------------------------------------------- transformations (xla)
def test_transformations_xla():
    case = Case(B=2, T=6, S=9, N=4, K=2, H=8, kwargs={"is_causal": True})
    q, k, v, kw = case.make()
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="xla", **kw)
    ref, _ = jax.jit(lambda q, k, v: oracle(q, k, v, **kw))(q, k, v)
    assert_close(f(q, k, v), ref, 1e-5, "eager")  # the one eager call of this file
    assert_close(jax.jit(f)(q, k, v), ref, 1e-5, "jit")
    vm = jax.jit(lambda q, k, v: jax.vmap(f, in_axes=(1, 1, 1), out_axes=1)(
        q[:, None], k[:, None], v[:, None])[:, 0])(q, k, v)
    assert_close(vm, ref, 1e-5, "vmap")
    loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
    g1, g2 = jax.jit(lambda q, k, v: (jax.grad(loss, argnums=(0, 1, 2))(q, k, v), jax.grad(
        jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    for a, b in zip(g1, g2):
        assert_close(b, a, 1e-5, "checkpoint")
    exp = jax.export.export(jax.jit(f))(q, k, v)
    back = jax.export.deserialize(exp.serialize())
    assert_close(back.call(q, k, v), ref, 1e-5, "export")


def test_what_jax_nn_accepts_runs_as_it_does():
    """Windows with a negative bound (keys only after / before the query: the reference
    serves them, explain says why the kernels do not), an integer or boolean bias, a scale
    traced under jit (a learned temperature: it scales the query, and gets its gradient), a
    one-element scale array: results and gradients as jax.nn.dot_product_attention's."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 9, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 11, 2, 8)), jnp.float32)
    visible = lambda o: np.asarray(o).any(-1)[..., None]   # jax.nn averages empty rows
    for w in ((-1, 3), (3, -2), -1, (5, -1)):
        for causal in (False, True):
            o = jaxflash.flash_attention(q, k, k, local_window_size=w, is_causal=causal)
            r = jax.nn.dot_product_attention(q, k, k, local_window_size=w, is_causal=causal)
            np.testing.assert_allclose(np.where(visible(o), o, 0), np.where(visible(o), r, 0),
                                       atol=1e-6)
    with jaxflash.target_platform("cuda"):
        s = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
        assert "negative bound" in str(jaxflash.explain(s, s, s, local_window_size=(-1, 3)))
    bias = jnp.asarray(rng.integers(-2, 3, (2, 2, 9, 11)), jnp.int32)
    for b in (bias, bias > 0):
        np.testing.assert_allclose(jaxflash.flash_attention(q, k, k, bias=b),
                                   jax.nn.dot_product_attention(q, k, k, bias=b), atol=1e-6)
    np.testing.assert_allclose(jaxflash.flash_attention(q, k, k, scale=np.array([0.7])),
                               jax.nn.dot_product_attention(q, k, k, scale=0.7), atol=1e-6)
    loss = lambda f: (lambda q, s: jnp.sum(jnp.sin(f(q, k, k, scale=s, is_causal=True))))
    ours = jax.jit(jax.value_and_grad(loss(jaxflash.flash_attention), argnums=(0, 1)))
    ref = jax.jit(jax.value_and_grad(loss(jax.nn.dot_product_attention), argnums=(0, 1)))
    for a, b in zip(jax.tree.leaves(ours(q, jnp.float32(0.7))),
                    jax.tree.leaves(ref(q, jnp.float32(0.7)))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_explain_takes_a_traced_scale():
    """explain plans a traced scale as flash_attention runs it (folded into the query)."""
    q = jnp.ones((1, 16, 2, 32), jnp.float32)

    def f(q, s):
        d = jaxflash.explain(q, q, q, scale=s, is_causal=True)
        assert d.backend is not None
        return jaxflash.flash_attention(q, q, q, scale=s, is_causal=True)

    jax.jit(f)(q, 0.3)
