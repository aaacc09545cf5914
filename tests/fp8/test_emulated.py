"""The emulated FP8 path (`jaxflash.fp8.emulated`): the numerics contract written out again in
NumPy (one key tile, one query block: the running max is the row max) must agree to float32
rounding, forward and backward; longer calls must stay within the stated bounds of a float64
reference; every mask / logit feature is served.

EMULATION_TOLERANCE: what an FP8 kernel is held to against this emulation (relative L2, the
same inputs and scales): output 2e-2, dq / dk / dv 5e-2 (its tiles, accumulation order and exp2
differ; FP8 rounding flips are then expected on a few elements)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxflash
from jaxflash import quantize as Q
from jaxflash._types import AttentionArrays, AttentionStatics, Fp8Spec
from jaxflash.fp8 import emulated
from jaxflash.fp8 import layout

EMULATION_TOLERANCE = dict(out=2e-2, dq=5e-2, dk=5e-2, dv=5e-2)
E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _fq(x, dt, fmax):
    """NumPy quantize-dequantize of a whole block with the amax rule."""
    amax = np.abs(x).max()
    s = np.float32(amax / np.float32(fmax)) if amax else np.float32(1)
    inv = np.float32(fmax) / np.float32(amax) if amax else np.float32(1)
    return np.clip(x * inv, -fmax, fmax).astype(dt).astype(np.float32) * s


def _p8(p):
    return np.clip(p * np.float32(256), 0, 448).astype(E4).astype(np.float32) / np.float32(256)


def _numpy_contract(q, k, v, qs, ks, vs, scale, causal, do, out, lse):
    """Forward and backward of jaxflash.fp8.contract for T, S <= 128 (one tile / block), MHA.
    q, k, v: FP8 codes as float32 [B, T, N, D]; scales [B, N]. out / lse: the emulation's (the
    backward takes the forward's results as given)."""
    qd = q * qs[:, None, :, None]
    kd = k * ks[:, None, :, None]
    vd = v * vs[:, None, :, None]
    s = np.einsum("btnd,bsnd->bnts", q, k) * qs[:, :, None, None] * ks[:, :, None, None]
    z = (s * np.float32(scale)).astype(np.float32)
    T, S = z.shape[-2:]
    if causal:
        z = np.where(np.tril(np.ones((T, S), bool)), z, -np.inf)
    m = z.max(-1, keepdims=True)
    p = np.exp(z - m)
    l = p.sum(-1)
    o = np.einsum("bnts,bsnd->btnd", _p8(p), vd) / l.transpose(0, 2, 1)[..., None]
    lse_np = (m[..., 0] + np.log(l))
    # backward
    B, _, N, D = q.shape
    do8 = np.stack([np.stack([_fq(do[b, :, n], E5, 57344.0) for n in range(N)], 1)
                    for b in range(B)])
    dvec = np.einsum("btnd,btnd->bnt", do8, out)   # from the quantized dO, as dP
    pb = np.exp(z - lse[..., None])
    dv = np.einsum("bnts,btnd->bsnd", _p8(pb), do8)
    dp = np.einsum("btnd,bsnd->bnts", do8, vd)
    dz = pb * (dp - dvec[..., None])
    # dS scales per 64 query rows x the key tile (contract BWD_DS_Q_TILE)
    ds8 = np.stack([np.stack([np.concatenate([_fq(dz[b, n, r:r + 64], E4, 448.0)
                                              for r in range(0, T, 64)])
                              for n in range(N)]) for b in range(B)])
    dq = np.float32(scale) * np.einsum("bnts,bsnd->btnd", ds8, kd)
    dk = np.float32(scale) * np.einsum("bnts,btnd->bsnd", ds8, qd)
    return o, lse_np, (dq, dk, dv)


def _statics(spec, scale, causal=False, **kw):
    return AttentionStatics(scale=scale, is_causal=causal, fp8=spec, **kw)


def test_contract_in_numpy_one_tile():
    B, T, N, D = 2, 96, 2, 64
    q, k, v, do = (_x((B, T, N, D), i) for i in range(4))
    k *= 2.0
    q8, qs = Q.quantize(q, granularity="head")
    k8, ks = Q.quantize(k, granularity="head")
    v8, vs = Q.quantize(v, jnp.float8_e4m3fn, granularity="head")
    spec = Fp8Spec(q_block=T, k_block=T, v_block=T, granularity=("head",) * 3,
                   out_dtype="float32")
    arrays = AttentionArrays(q_scale=qs[..., None], k_scale=ks[..., None], v_scale=vs[..., None])
    st = _statics(spec, 0.125, causal=True)

    @jax.jit
    def run(q8, k8, v8, arrays, do):
        out, lse = emulated.forward(q8, k8, v8, arrays, st)
        return out, lse, emulated.backward(q8, k8, v8, arrays, st, out, lse, do)[:3]

    out, lse, grads = run(q8, k8, v8, arrays, do)
    f = lambda a: np.asarray(a.astype(jnp.float32))
    o_np, lse_np, g_np = _numpy_contract(f(q8), f(k8), f(v8), np.asarray(qs), np.asarray(ks),
                                         np.asarray(vs), 0.125, True, do, np.asarray(out),
                                         np.asarray(lse))
    assert _rel(out, o_np) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), lse_np, atol=1e-5)
    for what, g, r in zip(("dq", "dk", "dv"), grads, g_np):
        assert _rel(g, r) < 1e-4, what


def _ref64(q, k, v, do, causal):
    """float64 out and grads, GQA by repeating kv heads."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    G = q.shape[2] // k.shape[2]
    ke, ve = np.repeat(k, G, 2), np.repeat(v, G, 2)
    sc = 1 / np.sqrt(q.shape[-1])
    s = np.einsum("btnd,bsnd->bnts", q, ke) * sc
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnd->btnd", p, ve)
    dp = np.einsum("btnd,bsnd->bnts", do, ve)
    ds = p * (dp - np.einsum("btnd,btnd->bnt", do, out)[..., None])
    dq = np.einsum("bnts,bsnd->btnd", ds, ke) * sc
    dk = np.einsum("bnts,btnd->bsnd", ds, q) * sc
    dv = np.einsum("bnts,btnd->bsnd", p, do)
    fold = lambda x: x.reshape(x.shape[:2] + (k.shape[2], G, x.shape[-1])).sum(3)
    return out, (dq, fold(dk), fold(dv))


def test_bounds_vs_float64_multi_tile_gqa_and_api_wiring():
    """T = S = 384 (three key tiles, three dO blocks), GQA, causal, through the API with
    precision="fp8": within 0.08 (output) / 0.12 (grads) of float64 (the recipe measures
    ~0.05 / ~0.08, benchmarks/results/fp8-accuracy-cpu.md), and the custom_vjp hands back
    exactly the emulated backward's gradients (straight-through)."""
    B, T, N, K, D = 1, 384, 4, 2, 64
    q, do = _x((B, T, N, D), 10), _x((B, T, N, D), 11)
    k, v = _x((B, T, K, D), 12), _x((B, T, K, D), 13)

    @jax.jit
    def run(q, k, v, do):
        f = lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True, precision="fp8",
                                                     hadamard=False)
        out, vjp = jax.vjp(f, q, k, v)
        # The same through emulated.backward directly.
        spec = Fp8Spec(out_dtype="float32", source="quantized")
        q8, qs = layout.quantize_canonical(q, "float8_e4m3fn", "block", 128)
        k8, ks = layout.quantize_canonical(k, "float8_e4m3fn", "block", 128)
        v8, vs = layout.quantize_canonical(v, "float8_e4m3fn", "block", 128)
        arr = AttentionArrays(q_scale=qs, k_scale=ks, v_scale=vs)
        st = _statics(spec, 1 / 8, causal=True)
        o2, lse = emulated.forward(q8, k8, v8, arr, st)
        direct = emulated.backward(q8, k8, v8, arr, st, o2, lse, do)[:3]
        return out, vjp(do), o2, direct

    out, grads, o2, direct = run(q, k, v, do)
    ref, gref = _ref64(q, k, v, do, True)
    assert np.array_equal(np.asarray(out), np.asarray(o2))
    assert _rel(out, ref) < 0.08
    for what, g, d, r in zip(("dq", "dk", "dv"), grads, direct, gref):
        assert np.array_equal(np.asarray(g), np.asarray(d)), what
        assert _rel(g, r) < 0.12, what


def test_features_and_empty_rows():
    """Every mask and logit feature of the float path, in one call, within FP8 noise of the
    float reference; a row with no visible key gives 0 / -inf; bias and ALiBi get gradients."""
    B, T, N, D = 2, 160, 2, 64
    rng = np.random.default_rng(3)
    q, k, v, w = (_x((B, T, N, D), 20 + i) for i in range(4))
    seg = np.cumsum(rng.random((B, T)) < 0.05, axis=1).astype(np.int32)
    kw = dict(softcap=20.0, local_window_size=(100, 30), q_segment_ids=seg, kv_segment_ids=seg,
              query_seq_lengths=np.array([150, 0], np.int32),
              key_value_seq_lengths=np.array([140, 160], np.int32),
              mask=rng.random((1, 1, T, T)) > 0.1)
    bias = 0.5 * _x((1, N, T, T), 30)
    alibi = np.array([0.05, 0.01], np.float32)

    @jax.jit
    def run(q, k, v, bias, alibi, w):
        def loss(prec, q, k, v, bias, alibi):
            out, lse = jaxflash.flash_attention(q, k, v, bias, alibi_slopes=alibi, precision=prec,
                                                return_residual=True, **kw)
            return jnp.sum(out * w), (out, lse)
        g = jax.grad(lambda *a: loss("fp8", *a), argnums=(3, 4), has_aux=True)
        gr = jax.grad(lambda *a: loss(None, *a), argnums=(3, 4), has_aux=True)
        return g(q, k, v, bias, alibi), gr(q, k, v, bias, alibi)

    ((db, da), (out, lse)), ((dbr, dar), (ref, lref)) = run(q, k, v, bias, alibi, w)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.all(out[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert np.all(out[0, 150:] == 0)
    assert _rel(out[0, :150], ref[0, :150]) < 0.08
    np.testing.assert_allclose(np.asarray(lse)[0, :150], np.asarray(lref)[0, :150], atol=0.1)
    assert _rel(db, dbr) < 0.15 and _rel(da, dar) < 0.15


def test_no_t_by_s_tensor():
    """The emulation keeps O(T x tile) per head: lowered forward + backward at T = S = 1024
    hold no [..., 1024, 1024] array (lowering only, no compile)."""
    s = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(jaxflash.flash_attention(q, k, v, is_causal=True, precision="fp8"))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(s, s, s).as_text()
    assert "1024x1024" not in text and "1024,1024" not in text
    assert "128x" in text or ",128]" in text or "x128x" in text   # the key tiles are there
