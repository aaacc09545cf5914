"""The ``cudnn`` backend on a machine without a GPU: what it serves and refuses (and says why),
where dispatch puts it, and the wrapper that brings cuDNN to jaxflash's semantics.

The wrapper is checked end to end against the float32 reference by standing in for cuDNN with
`_FakeCudnn`: the same math with cuDNN's masks (top-left causal, left-bounded window, padding),
and cuDNN's quirks made loud: a fully masked row gives NaN or the values' average, padded query
rows and keys and the bias gradient there get garbage, the bias gradient is summed over a
broadcast batch including that garbage. The real cuDNN is checked on the H200 by
tests/backends/test_cudnn_gpu.py; lowering the real calls for CUDA is checked here.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import dispatch
from jaxflash._types import AttentionArrays, AttentionStatics, Problem
from jaxflash.backends import cudnn
from tests.common import FWD_TOL, GRAD_TOL, Case, assert_close, fresh_key

HOPPER = cudnn._Env(cc=(9, 0), cudnn=91900)
AMPERE = cudnn._Env(cc=(8, 0), cudnn=91900)


@pytest.fixture
def hopper(monkeypatch):
    """Plan as on an H200 with cuDNN 9.19 (JAX's CUDA plugin is not installed here)."""
    monkeypatch.setattr(cudnn, "_env", lambda: HOPPER)


def _problem(T=64, S=64, N=4, K=4, H=64, Hv=None, dtype="bfloat16", platform="cuda",
             bias=False, **kw):
    flags = {n: kw.pop(n) for n in ("has_mask", "has_q_seqlen", "has_kv_seqlen", "has_alibi",
                                     "has_segments") if n in kw}
    statics = AttentionStatics(scale=0.125, **kw)
    return Problem(batch=2, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, head_dim=H,
                   head_dim_v=Hv or H, dtype=dtype, statics=statics,
                   bias_shape=(1, N, T, S) if bias else None, platform=platform, **flags)


def _refusal(problem):
    with pytest.raises(NotImplementedError) as e:
        cudnn.CudnnBackend().plan(problem)
    return str(e.value)


# ------------------------------------------------------------------ what it serves and refuses
def test_jax_internals_here_are_known():
    api, why = cudnn._api()
    assert api is not None, why
    # jax 0.12 added score_mod to the backward rule's arguments; 0.10 / 0.11 do not have it.
    major_minor = tuple(int(x) for x in jax.__version__.split(".")[:2])
    assert api.bwd_takes_score_mod is (major_minor >= (0, 12))


def test_unknown_jax_internals_are_refused_not_guessed(monkeypatch, hopper):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    monkeypatch.setattr(fa, "_dot_product_attention_bwd_rule", lambda scale, res, g: None)
    api, why = cudnn._api.__wrapped__()
    assert api is None and "not those jaxflash knows" in why
    monkeypatch.setattr(cudnn, "_api", lambda: (None, why))
    assert "not those jaxflash knows" in _refusal(_problem())


def test_refusals_say_why(hopper):
    cases = {
        "NVIDIA GPUs only": _problem(platform="cpu"),
        "float16 / bfloat16, not float32": _problem(dtype="float32"),
        "head dim 36: cuDNN takes multiples of 8 up to 256": _problem(H=36),
        "head dim 320": _problem(H=320),
        "value head dim 76": _problem(Hv=76),
        "softcap": _problem(softcap=5.0),
        "ALiBi": _problem(has_alibi=True),
        "segment ids": _problem(has_segments=True),
        "--xla_gpu_deterministic_ops=true": _problem(deterministic=True),
        "window (3, 2) without is_causal": _problem(window=(3, 2)),
        "needs T <= S": _problem(T=80, window=(3, 0)),
        "T = 63, S = 64": _problem(T=63, bias=True),
        "T = 64, S = 9": _problem(S=9, has_mask=True),
    }
    for want, problem in cases.items():
        assert want in _refusal(problem), (want, _refusal(problem))


def test_before_hopper_and_without_a_gpu_head_dims_stop_at_128(monkeypatch):
    for env, where in ((AMPERE, "sm_80"), (cudnn._Env(None, 91900), "no GPU visible")):
        monkeypatch.setattr(cudnn, "_env", lambda env=env: env)
        why = _refusal(_problem(H=192))
        assert "up to 128" in why and where in why, why
        assert "Hopper or newer" in _refusal(_problem(H=128, Hv=64))
        cudnn.CudnnBackend().plan(_problem(H=128))  # served
    monkeypatch.setattr(cudnn, "_env", lambda: HOPPER)
    for H, Hv in ((256, 256), (192, 128), (80, 80)):
        cudnn.CudnnBackend().plan(_problem(H=H, Hv=Hv))


def test_no_cudnn_in_this_process_is_a_refusal(monkeypatch):
    # This machine as it is: either JAX's CUDA plugin is here, or the refusal says it is not.
    env = cudnn._env.__wrapped__()
    assert env.cudnn is not None or "CUDA plugin" in env.why
    monkeypatch.setattr(cudnn, "_env", lambda: cudnn._Env(None, None, "cuDNN is not available"))
    assert "cuDNN is not available" in _refusal(_problem())


def test_deterministic_with_the_xla_flag(hopper, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    cudnn.CudnnBackend().plan(_problem(deterministic=True))


def test_mapping_onto_cudnn(hopper):
    plan = lambda **kw: cudnn.CudnnBackend().plan(_problem(**kw))
    assert plan().mask_type == "NO_MASK" and plan().window is None
    assert plan(is_causal=True).mask_type == "CAUSAL"
    assert plan(has_kv_seqlen=True).mask_type == "PADDING"
    assert plan(has_q_seqlen=True, is_causal=True).mask_type == "PADDING_CAUSAL"
    # (left, 0) is causal with a left bound; cuDNN's window length is left + 1.
    d = plan(window=(3, 0))
    assert (d.mask_type, d.window) == ("CAUSAL", 4)
    d = plan(window=(5, 7), is_causal=True)
    assert (d.mask_type, d.window) == ("CAUSAL", 6)
    # A left bound that removes nothing (left >= T - 1) is dropped.
    assert plan(window=(63, 0)).window is None and plan(window=(62, 0)).window == 63
    assert plan(bias=True).dense and plan(has_mask=True).dense and not plan().dense
    assert plan(S=77, T=33).mask_type == "NO_MASK"  # odd lengths without a bias are fine


# ------------------------------------------------------------------ dispatch
def _sds(B=2, T=64, S=64, N=4, K=4, H=64, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, S, K, H), dtype),
            jax.ShapeDtypeStruct((B, S, K, H), dtype))


def test_dispatch_wiring():
    assert "cudnn" in dispatch.IMPLEMENTATIONS
    for platform in ("cuda", "gpu"):
        assert dispatch._PREFERENCE[platform] == ("cute", "cudnn", "pallas", "xla")
    for platform in ("rocm", "tpu"):
        assert "cudnn" not in dispatch._PREFERENCE[platform]
    assert isinstance(dispatch.get_backend("cudnn"), cudnn.CudnnBackend)


def test_explain_picks_cudnn_when_cute_refuses_a_call_it_serves(hopper):
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(*_sds(H=80), is_causal=True)  # cute: head dims 64/96/128/192/256
        assert d.backend == "cudnn", str(d)
        refused = dict(d.refused)
        assert "head dim 80" in refused["cute"] and "cudnn" not in refused
        text = str(d)
        assert "'cudnn' runs (best available)" in text and "cuDNN fused attention" in text
        assert "mask CAUSAL" in text
        # A bias: cute sends it on, cuDNN takes it.
        q, k, v = _sds()
        d = jaxflash.explain(q, k, v, bias=jax.ShapeDtypeStruct((1, 4, 64, 64), jnp.float32))
        assert d.backend == "cudnn" and "cute" in dict(d.refused), str(d)
        # What both refuse goes on to pallas, with cuDNN's reason listed.
        d = jaxflash.explain(*_sds(H=80), softcap=10.0)
        assert d.backend == "pallas" and "softcap" in dict(d.refused)["cudnn"], str(d)
        # Named: cudnn is used even where cute would serve.
        d = jaxflash.explain(*_sds(), is_causal=True, implementation="cudnn")
        assert d.backend == "cudnn" and d.requested == "cudnn"


def test_explain_keeps_cute_first_where_it_serves(hopper):
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(*_sds(H=64), is_causal=True)
    if dict(d.refused).get("cute") is None:  # the CuTe DSL (or its artifacts) is here
        assert d.backend == "cute" and "cudnn" not in dict(d.refused), str(d)


def test_cpu_refuses_and_named_call_raises():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with jaxflash.target_platform("cpu"):
        d = jaxflash.explain(q, q, q)
        assert d.backend == "xla"
        assert "not used automatically on cpu" in dict(d.refused)["cudnn"]
        with pytest.raises(NotImplementedError, match="NVIDIA GPUs only"):
            jaxflash.flash_attention(q, q, q, implementation="cudnn")


# ------------------------------------------------------------------ fully masked rows
@pytest.mark.parametrize("seed", range(3))
def test_empty_rows_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    B, N, T, S = 3, 2, int(rng.integers(5, 40)), int(rng.integers(5, 40))
    for _ in range(5):
        causal = bool(rng.integers(2))
        window = None if rng.integers(2) else (int(rng.integers(0, 8)), int(rng.integers(0, 8)))
        qlen = jnp.asarray(rng.integers(-1, T + 2, B), jnp.int32) if rng.integers(2) else None
        kvlen = jnp.asarray(rng.integers(-1, S + 2, B), jnp.int32) if rng.integers(2) else None
        mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.15) if rng.integers(2) else None
        bias = None
        if rng.integers(2):
            bias = jnp.asarray(rng.normal(size=(1, N, T, S)), jnp.float32)
            bias = bias.at[:, :, 1].set(-jnp.inf)  # a row -inf throughout: empty
        arrays = AttentionArrays(bias=bias, mask=mask, q_seqlen=qlen, kv_seqlen=kvlen)
        statics = AttentionStatics(scale=1.0, is_causal=causal, window=window)
        q = jnp.ones((B, T, N, 8))
        k = jnp.ones((B, S, N, 8))
        _, lse = jax.jit(jaxflash.reference.attention, static_argnums=4)(q, k, k, arrays,
                                                                         statics)
        got = jax.jit(cudnn.empty_rows, static_argnums=(1, 2, 3))(arrays, statics, T, S)
        want = np.isneginf(np.asarray(lse))
        if got is None:
            assert not want.any()
        else:
            np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), want.shape), want,
                                          err_msg=f"{causal=} {window=} {qlen=} {kvlen=}")


def test_dense_bias_masks_by_setting_not_adding():
    bias = jnp.array([[[[1.0, -jnp.inf, 70000.0, -1e9]]]])
    mask = jnp.array([[[[True, True, True, False]]]])
    for dt, neg in ((jnp.bfloat16, -(2.0 ** 41)), (jnp.float16, -(2.0 ** 15))):
        got = cudnn._dense_bias(AttentionArrays(bias=bias, mask=mask), dt)
        assert got.dtype == dt and bool(jnp.all(jnp.isfinite(got)))
        assert float(got[0, 0, 0, 0]) == 1.0 and float(got[0, 0, 0, 3]) == neg
        assert float(got[0, 0, 0, 1]) == neg  # -inf: clipped to the masked value
        only = cudnn._dense_bias(AttentionArrays(mask=mask), dt)
        assert [float(x) for x in only[0, 0, 0]] == [0.0, 0.0, 0.0, neg]


# ------------------------------------------------------------------ the wrapper, end to end
class _FakeCudnn:
    """JAX's cuDNN entry points as the backend calls them, computed in float32 with cuDNN's
    masks and its quirks made loud (see the module docstring)."""

    MaskType = None
    AttentionLayout = None

    def __init__(self):
        from jax._src.cudnn import fused_attention_stablehlo as fa
        self.MaskType, self.AttentionLayout = fa.MaskType, fa.AttentionLayout
        self.calls = []
        self._dot_product_attention_bwd_p_wrapper = types.SimpleNamespace(bind=self._bwd)

    @staticmethod
    def _logits(q, k, bias, qlen, kvlen, scale, mask_type, window):
        B, T, N, _ = q.shape
        S, K = k.shape[1], k.shape[2]
        kr = jnp.repeat(k.astype(jnp.float32), N // K, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kr,
                       precision=jax.lax.Precision.HIGHEST) * scale
        if bias is not None:
            s = s + bias.astype(jnp.float32)
        i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
        vis = jnp.ones((1, 1, T, S), bool)
        name = mask_type.name
        if "CAUSAL" in name:
            vis = vis & (j <= i)  # top-left
        if window is not None:
            assert "CAUSAL" in name and T <= S  # (cuDNN refuses a window with T > S)
            vis = vis & (j > i - window)
        pad = None
        if "PADDING" in name:
            pad = (i[None] < qlen[:, None, None]) & (j[None] < kvlen[:, None, None])  # [B,T,S]
            vis = vis & pad[:, None]
        return jnp.where(vis, s, -jnp.inf), pad

    def dot_product_attention(self, q, k, v, bias=None, mask=None, q_seqlen=None,
                              kv_seqlen=None, *, scale, mask_type, qkv_layout,
                              sliding_window_length, return_residual):
        assert mask is None and qkv_layout == "BTNH" and return_residual
        assert q.dtype == k.dtype == v.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
        assert bias is None or bias.dtype == q.dtype
        self.calls.append(("fwd", mask_type.name, sliding_window_length))
        s, pad = self._logits(q, k, bias, q_seqlen, kv_seqlen, scale, mask_type,
                              sliding_window_length)
        N, K = q.shape[2], k.shape[2]
        m = jnp.max(s, axis=-1, keepdims=True)  # no guards: a fully masked row gives NaN
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        vr = jnp.repeat(v.astype(jnp.float32), N // K, axis=2)
        o = jnp.einsum("bnts,bsnh->btnh", p / l, vr, precision=jax.lax.Precision.HIGHEST)
        lse = (m + jnp.log(l))[..., 0]
        if pad is not None:  # padded query rows: unwritten
            rows = jnp.arange(q.shape[1])[None] >= q_seqlen[:, None]  # [B, T]
            o = jnp.where(rows[:, :, None, None], 7.0, o)
            lse = jnp.where(rows[:, None], 123.0, lse)
        return o.astype(q.dtype), lse

    def _bwd(self, q, k, v, bias, qlen, kvlen, qo, kvo, ptk, ptv, stats, out, dout, *, scale,
             seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length):
        has_bias, has_dbias = variadic_args
        assert layout == self.AttentionLayout.BTNH.value and dropout_rate == 0.0
        assert stats.dtype == jnp.float32 and out.dtype == dout.dtype == q.dtype
        self.calls.append(("bwd", mask_type.name, sliding_window_length, variadic_args))
        bias = bias if has_bias else None
        if "PADDING" not in mask_type.name:
            qlen = kvlen = None
        s, pad = self._logits(q, k, bias, qlen, kvlen, scale, mask_type, sliding_window_length)
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        G = N // K
        f32 = lambda x: x.astype(jnp.float32)
        hp = jax.lax.Precision.HIGHEST
        p = jnp.exp(s - stats[..., None])
        kr, vr = jnp.repeat(f32(k), G, axis=2), jnp.repeat(f32(v), G, axis=2)
        dp = jnp.einsum("btnh,bsnh->bnts", f32(dout), vr, precision=hp)
        dd = jnp.swapaxes(jnp.sum(f32(dout) * f32(out), axis=-1), 1, 2)  # [B, N, T]
        ds = p * (dp - dd[..., None])
        dq = scale * jnp.einsum("bnts,bsnh->btnh", ds, kr, precision=hp)
        dk = scale * jnp.einsum("bnts,btnh->bsnh", ds, f32(q), precision=hp)
        dv = jnp.einsum("bnts,btnh->bsnh", p, f32(dout), precision=hp)
        dk = dk.reshape(B, S, K, G, H).sum(3)
        dv = dv.reshape(B, S, K, G, -1).sum(3)
        if pad is not None:  # not written by cuDNN
            dq = jnp.where((jnp.arange(T)[None] >= qlen[:, None])[:, :, None, None], 5.0, dq)
            gone = (jnp.arange(S)[None] >= kvlen[:, None])[:, :, None, None]
            dk, dv = jnp.where(gone, 3.0, dk), jnp.where(gone, 3.0, dv)
        grads = [dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)]
        if has_dbias:
            if pad is not None:
                ds = jnp.where(pad[:, None], ds, 2.0)
            axes = tuple(a for a in (0, 1) if bias.shape[a] == 1 and ds.shape[a] != 1)
            grads.append(jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype))
        return grads


@pytest.fixture
def fake(monkeypatch, hopper):
    f = _FakeCudnn()
    monkeypatch.setattr(cudnn, "_api", lambda: (cudnn._Api(f, False), None))
    return f


def _run(case, impl="cudnn"):
    """(out, lse, grads) through flash_attention, and the reference's, for `case`."""
    q, k, v, kw = case.make()
    w = jax.random.normal(fresh_key(), q.shape[:-1] + (v.shape[-1],), jnp.float32)
    bias = kw.pop("bias", None)

    def loss(q, k, v, bias, impl):
        out, lse = jaxflash.flash_attention(q, k, v, bias=bias, implementation=impl,
                                            return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ())
    # jit: one compile instead of op-by-op dispatch (slow on CPU)
    run = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True), static_argnums=4)
    with jaxflash.target_platform("cuda"):
        grads, (out, lse) = run(q, k, v, bias, impl)
    up = lambda x: x.astype(jnp.float32)
    rgrads, (rout, rlse) = run(up(q), up(k), up(v), bias, "xla")
    return (out, lse, grads), (rout, rlse, rgrads)


CASES = {
    "plain": Case(T=32, S=48, H=64, dtype="bfloat16"),
    "odd_gqa": Case(T=17, S=29, N=4, K=2, H=64, dtype="float16"),
    "causal_t<s": Case(T=16, S=40, H=64, dtype="bfloat16", kwargs={"is_causal": True}),
    "causal_t>s": Case(T=40, S=16, H=64, dtype="bfloat16", kwargs={"is_causal": True}),
    # Rows past kv length + left see no key at all.
    "window_past_keys": Case(B=2, T=24, S=32, N=2, K=1, H=64, dtype="bfloat16",
                             kwargs={"is_causal": True, "local_window_size": (4, 9),
                                     "key_value_seq_lengths": jnp.array([32, 10], jnp.int32)}),
    "window_left_only": Case(T=24, S=24, H=64, dtype="float16",
                             kwargs={"local_window_size": (5, 0)}),
    "lengths": Case(B=3, T=20, S=24, H=64, dtype="bfloat16",
                    kwargs={"is_causal": True,
                            "query_seq_lengths": jnp.array([20, 7, 0], jnp.int32),
                            "key_value_seq_lengths": jnp.array([24, 0, 30], jnp.int32)}),
    "bias_mask_lengths": Case(B=3, T=16, S=24, N=4, K=2, H=64, dtype="bfloat16", bias=True,
                              mask=True,
                              kwargs={"key_value_seq_lengths": jnp.array([24, 5, 0], jnp.int32),
                                      "query_seq_lengths": jnp.array([9, 16, 16], jnp.int32)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapper_gives_jaxflash_semantics(fake, name):
    case = CASES[name]
    (out, lse, grads), (rout, rlse, rgrads) = _run(case)
    dt = case.dtype
    assert_close(out, rout, FWD_TOL[dt], f"{name} out")
    assert_close(lse, rlse, 1e-2, f"{name} lse")  # -inf rows must match exactly
    empty = np.isneginf(np.asarray(rlse))  # [B, T, N]
    assert np.all(np.asarray(out, np.float32)[empty] == 0), "fully masked rows must be 0"
    for i, (g, r) in enumerate(zip(grads, rgrads)):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{name} grad {i} not finite"
        assert_close(g, r, GRAD_TOL[dt], f"{name} grad {i}")
    assert np.all(np.asarray(grads[0], np.float32)[empty] == 0), "dq of fully masked rows"
    assert [c[0] for c in fake.calls] == ["fwd", "bwd"]


def test_bias_gradient_over_a_broadcast_batch_excludes_padding(fake):
    """cuDNN sums dbias over a size-1 bias batch including what it leaves unwritten past the
    lengths: the wrapper hands it the full batch and sums itself."""
    case = Case(B=3, T=8, S=12, N=2, K=2, H=64, dtype="bfloat16",
                kwargs={"key_value_seq_lengths": jnp.array([12, 3, 7], jnp.int32)})
    q, k, v, kw = case.make()
    bias = jax.random.normal(fresh_key(), (1, 1, 8, 12))

    def loss(bias, impl):
        return jnp.sum(jaxflash.flash_attention(q, k, v, bias=bias, implementation=impl, **kw)
                       .astype(jnp.float32) ** 2)

    with jaxflash.target_platform("cuda"):
        got = jax.jit(jax.grad(loss), static_argnums=1)(bias, "cudnn")
    up = lambda x: x.astype(jnp.float32)
    want = jax.jit(jax.grad(lambda b: jnp.sum(jaxflash.flash_attention(
        up(q), up(k), up(v), bias=b, implementation="xla", **kw) ** 2)))(bias)
    assert got.shape == (1, 1, 8, 12)
    assert_close(got, want, GRAD_TOL["bfloat16"], "dbias")


def test_backward_honours_the_given_out_and_lse(fake):
    """Ring attention hands each block's backward the merged (out, lse) of all blocks: the sum
    of the blocks' gradients must be the whole call's."""
    from jaxflash.ring import _merge
    B, T, S, N, H = 2, 16, 32, 2, 64
    q, k, v, _ = Case(B=B, T=T, S=S, N=N, K=N, H=H, dtype="bfloat16").make()
    statics = AttentionStatics(scale=H ** -0.5)
    backend = dispatch.get_backend("cudnn")
    blocks = [(slice(0, 12), AttentionArrays()), (slice(12, S), AttentionArrays())]
    dout = jax.random.normal(fresh_key(), (B, T, N, H)).astype(q.dtype)

    @jax.jit
    def blockwise(q, k, v, dout):
        plans = []
        out = jnp.zeros((B, T, N, H), jnp.float32)
        lse = jnp.full((B, N, T), -jnp.inf)
        for sl, arr in blocks:
            kb, vb = k[:, sl], v[:, sl]
            problem = Problem.from_arrays(q, kb, vb, arr, statics, "cuda")
            _, plan = dispatch.select(problem, "cudnn")
            ob, lb = backend.forward(q, kb, vb, arr, statics, plan)
            out, lse = _merge(out, lse, ob, lb)
            plans.append(plan)
        out = out.astype(q.dtype)
        dq, dks, dvs = 0.0, [], []
        for (sl, arr), plan in zip(blocks, plans):
            g = backend.backward(q, k[:, sl], v[:, sl], arr, statics, plan, out, lse, dout)
            dq = dq + g[0].astype(jnp.float32)
            dks.append(g[1])
            dvs.append(g[2])
        return dq, dks, dvs

    dq, dks, dvs = blockwise(q, k, v, dout)
    up = lambda x: x.astype(jnp.float32)
    rq, rk, rv = jax.jit(lambda q, k, v, d: jax.vjp(
        lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="xla"),
        q, k, v)[1](d))(up(q), up(k), up(v), up(dout))
    tol = GRAD_TOL["bfloat16"]
    assert_close(dq, rq, tol, "dq")
    assert_close(jnp.concatenate(dks, 1), rk, tol, "dk")
    assert_close(jnp.concatenate(dvs, 1), rv, tol, "dv")


# ------------------------------------------------------------------ lowering the real calls
def test_grad_lowers_to_the_cudnn_custom_calls(hopper, monkeypatch):
    """The real JAX cuDNN calls (forward and our backward bind), lowered for CUDA from here."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
    B, T, S, N, K, H = 2, 64, 96, 4, 2, 64
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

    def f(q, k, v, bias):
        out = jaxflash.flash_attention(q, k, v, bias=bias, is_causal=True,
                                       local_window_size=(16, 0),
                                       key_value_seq_lengths=jnp.array([96, 50], jnp.int32),
                                       implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    with jaxflash.target_platform("cuda"):
        try:
            low = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).trace(
                sds(B, T, N, H), sds(B, S, K, H), sds(B, S, K, H),
                jax.ShapeDtypeStruct((1, N, T, S), jnp.float32)).lower(
                lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"this jax cannot lower cuDNN attention for CUDA without a GPU: {e}")
    txt = low.as_text()
    assert txt.count("custom_call @__cudnn$fmhaScaleBiasSoftmax(") == 1, "forward"
    assert txt.count("custom_call @__cudnn$fmhaScaleBiasSoftmaxBackward(") == 1, "backward"
    assert "PADDING_CAUSAL" in txt and "sliding_window_length\\22:17" in txt.replace(" ", "")
