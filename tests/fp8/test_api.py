"""The FP8 / FP4 API of `jaxflash.flash_attention` and `explain`: every caller mistake is a
ValueError naming what is wrong, a backend that cannot do FP8 a NotImplementedError, and
`explain` says what runs. Shapes only where possible (no compiles)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import quantize as Q

B, T, N, K, D = 2, 256, 4, 2, 64
S8 = jax.ShapeDtypeStruct
q8 = S8((B, T, N, D), jnp.float8_e4m3fn)
k8 = S8((B, T, K, D), jnp.float8_e4m3fn)
v8 = S8((B, T, K, D), jnp.float8_e5m2)
qs, ks, vs = S8((B, N, 2), jnp.float32), S8((), jnp.float32), S8((B, K), jnp.float32)
qb = S8((B, T, N, D), jnp.bfloat16)
kb = S8((B, T, K, D), jnp.bfloat16)
SC = dict(q_scale=qs, k_scale=ks, v_scale=vs)


def _explain(*a, **kw):
    return str(jaxflash.explain(*a, **kw))


@pytest.mark.parametrize("args,kw,match", [
    ((q8, k8, v8), {}, r"missing q_scale, k_scale, v_scale"),
    ((q8, k8, v8), dict(q_scale=qs, k_scale=ks), r"missing v_scale"),
    ((q8, k8, v8), dict(SC, q_scale=S8((B, N, 3), jnp.float32)),
     r"q_scale: scale shape \(2, 4, 3\) fits no layout for an operand of shape \(2, 256, 4, 64\)"
     r".*block \(2, 4, 2\)"),
    ((q8, k8, v8), dict(SC, k_scale=S8((K,), jnp.float32)), r"k_scale: scale shape \(2,\)"),
    ((q8, k8, v8), dict(SC, scale_block=64), r"q_scale: .*\(2, 4, 4\)"),
    ((q8, kb, kb), SC, r"all FP8 .* or all float16"),
    ((qb, kb, kb), dict(q_scale=qs), r"q_scale given with non-FP8 inputs"),
    ((S8((B, T, N, D), jnp.float8_e4m3fnuz), k8, v8), SC,
     r"all FP8 \(float8_e4m3fn / float8_e5m2\).*float8_e4m3fnuz"),
    ((q8, k8, v8), dict(SC, v_scale=S8((B, K), jnp.bool_)), r"v_scale must be a float32"),
    ((q8, k8, v8), dict(SC, hadamard=True), r"hadamard=True with FP8 inputs"),
    ((q8, k8, v8), dict(SC, precision="fp8", hadamard_seed=3), r"hadamard_seed=3 with FP8"),
    ((q8, k8, v8), dict(SC, scale_granularity="tensor"), r"scale_granularity='tensor' with FP8"),
    ((q8, k8, v8), dict(SC, out_dtype=jnp.int8), r"out_dtype must be"),
    ((q8, k8, v8), dict(SC, scale_block=0), r"scale_block must be a positive int"),
    ((qb, kb, kb), dict(out_dtype=jnp.float32), r"out_dtype is for FP8 calls"),
    ((qb, kb, kb), dict(precision="fp16"), r"precision must be None, 'fp8' or 'fp4'"),
    ((S8((B, T, N, 96), jnp.bfloat16), S8((B, T, K, 96), jnp.bfloat16),
      S8((B, T, K, 96), jnp.bfloat16)), dict(precision="fp8", hadamard=True),
     r"hadamard=False"),
    ((qb, kb, kb), dict(precision="fp8", scale_granularity="row"), r"scale_granularity"),
    ((qb, kb, kb), dict(precision="fp8", dout_dtype=jnp.bfloat16), r"dout_dtype"),
    ((qb, kb, kb), dict(precision="fp8", emulate=True, implementation="pallas"),
     r"contradicts implementation='pallas'"),
    ((qb, kb, kb), dict(emulate=True), r"emulate=True is for precision"),
    ((q8, k8, v8), dict(SC, precision="fp4", emulate=True), r"precision='fp4' quantizes"),
])
def test_value_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        jaxflash.explain(*args, **kw)
    with pytest.raises(ValueError, match=match):  # flash_attention validates before any work
        jaxflash.flash_attention(*(jnp.zeros(a.shape, a.dtype) for a in args),
                                 **{n: (jnp.zeros(v.shape, v.dtype) if isinstance(v, S8) else v)
                                    for n, v in kw.items()})


def test_hadamard_by_default_where_the_head_dim_takes_it():
    """precision="fp8" at a head dim the transform does not take (96) runs without it (the
    Flax layers cannot pass hadamard=False), and says so; where it does, it is on."""
    import jaxflash
    x96, x64 = (S8((B, T, N, d), jnp.bfloat16) for d in (96, 64))
    assert ("no Hadamard transform (head dim 96: the transform takes"
            in str(jaxflash.explain(x96, x96, x96, precision="fp8")))
    assert "random-sign Hadamard" in str(jaxflash.explain(x64, x64, x64, precision="fp8"))


@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_backends_without_fp8_refuse(impl):
    p = jaxflash.explain(q8, k8, v8, implementation=impl, **SC)
    assert p.backend is None and "FP8" in str(p)
    with jaxflash.target_platform("cuda"):
        assert "FP8" in _explain(qb, kb, kb, precision="fp8", implementation=impl)
        with pytest.raises(NotImplementedError, match="FP8"):
            jaxflash.flash_attention(jnp.zeros(qb.shape, qb.dtype), jnp.zeros(kb.shape, kb.dtype),
                                     jnp.zeros(kb.shape, kb.dtype), precision="fp8",
                                     implementation=impl)


def test_cute_fp8_kernel_serves_e4m3_and_refuses_the_rest():
    with jaxflash.target_platform("cuda"):
        p = jaxflash.explain(qb, kb, kb, precision="fp8", implementation="cute")
        assert p.backend == "cute" and "FlashFwdSm90Fp8" in str(p)
        assert "backward: CuTe FP8 kernel FlashBwdSm90Fp8" in str(p)  # the backward named too
        # E5M2 V is outside the kernel's operand set: asked by name it refuses, naming why.
        p = jaxflash.explain(q8, k8, v8, implementation="cute", **SC)
        assert p.backend is None and "e4m3 only" in str(p), str(p)
        with pytest.raises(NotImplementedError, match="e4m3 only"):
            jaxflash.flash_attention(jnp.zeros(q8.shape, q8.dtype), jnp.zeros(k8.shape, k8.dtype),
                                     jnp.zeros(v8.shape, v8.dtype), implementation="cute",
                                     **{n: jnp.ones(a.shape, a.dtype) for n, a in SC.items()})
    # Off CUDA the CuTe kernel cannot run at all.
    p = jaxflash.explain(q8, k8, k8, implementation="cute", **SC)
    assert p.backend is None and "CUDA" in str(p)


def test_explain_says_what_runs_and_why():
    with jaxflash.target_platform("cuda"):   # the automatic choice is the FP8 kernel
        p = jaxflash.explain(qb, kb, kb, is_causal=True, precision="fp8")
        text = str(p)
        assert p.backend == "cute" and p.problem.dtype == "float8_e4m3fn"
        for want in ("FlashFwdSm90Fp8", "random-sign Hadamard", "per-block (128 rows",
                     "E5M2 dO", "straight-through", "output bfloat16"):
            assert want in text, (want, text)
        # E5M2 V: no kernel serves it, so the emulation runs and explain says why.
        p = jaxflash.explain(q8, k8, v8, **SC)
        text = str(p)
        assert p.backend == "xla"
        for want in ("emulated FP8 path", "no FP8 kernel can serve", "'cute' refused",
                     "'cudnn' refused", "inputs given in FP8", "q e4m3fn per-block",
                     "k e4m3fn per-tensor", "v e5m2 per-(batch, head)", "no Hadamard",
                     "FP8 cotangents", "output bfloat16"):
            assert want in text, (want, text)
    assert "asked for" in _explain(q8, k8, v8, emulate=True, **SC)
    assert "E4M3 dO" in _explain(qb, kb, kb, precision="fp8", dout_dtype=jnp.float8_e4m3fn,
                                 hadamard=False)


def test_fp8_inputs_run_with_each_layout_and_out_dtype():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s.shape).astype(np.float32) for s in (qb, kb, kb))

    @jax.jit
    def run(q, k, v):
        a8, a_s = Q.quantize(q, granularity="block")
        b8, b_s = Q.quantize(k, granularity="tensor")
        c8, c_s = Q.quantize(v, jnp.float8_e5m2, granularity="head")
        o1 = jaxflash.flash_attention(a8, b8, c8, q_scale=a_s, k_scale=b_s, v_scale=c_s)
        o2 = jaxflash.flash_attention(a8, b8, c8, q_scale=a_s, k_scale=b_s, v_scale=c_s,
                                      out_dtype=jnp.float32)
        # precision="fp8" and hadamard=False say what FP8 inputs are; an integer scale is a
        # number like any other
        o3 = jaxflash.flash_attention(a8, b8, b8, q_scale=a_s, k_scale=b_s, v_scale=1,
                                      precision="fp8", hadamard=False)
        o4 = jaxflash.flash_attention(a8, b8, b8, q_scale=a_s, k_scale=b_s, v_scale=1.0)
        return o1, o2, jaxflash.flash_attention(q, k, v), o3, o4

    o1, o2, ref, o3, o4 = run(q, k, v)
    np.testing.assert_array_equal(np.asarray(o3, np.float32), np.asarray(o4, np.float32))
    assert o1.dtype == jnp.bfloat16 and o2.dtype == jnp.float32
    rel = np.linalg.norm(np.asarray(o2) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert rel < 0.08
    assert np.allclose(np.asarray(o1, np.float32), np.asarray(o2), atol=2e-2)


def test_fp4_is_routed_to_jaxflash_fp4():
    from jaxflash.fp4 import fp4_attention
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.float32) for _ in range(3))
    out = jaxflash.flash_attention(q, k, v, precision="fp4", emulate=True, is_causal=True)
    assert np.array_equal(np.asarray(out),
                          np.asarray(fp4_attention(q, k, v, emulate=True, is_causal=True)))
    p = jaxflash.explain(q, k, v, precision="fp4", emulate=True)
    assert p.backend and "fp4" in p.backend and "Direct-P" in str(p)
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert jaxflash.explain(q, k, v, precision="fp4").backend is None
        with pytest.raises(NotImplementedError, match="sm_100a"):
            jaxflash.flash_attention(q, k, v, precision="fp4")
    with pytest.raises(NotImplementedError, match="softcap"):
        jaxflash.flash_attention(q, k, v, precision="fp4", emulate=True, softcap=5.0)


def test_fp8_with_mods_is_refused():
    with pytest.raises(NotImplementedError, match="score_mod"):
        jaxflash.flash_attention(jnp.zeros(qb.shape, qb.dtype), jnp.zeros(kb.shape, kb.dtype),
                                 jnp.zeros(kb.shape, kb.dtype), precision="fp8",
                                 score_mod=lambda s, b, h, q, k: s * 0.5)


@pytest.mark.parametrize("kw", [dict(hadamard_seed=3), dict(hadamard=True),
                                dict(scale_granularity="head"), dict(dout_dtype=jnp.float8_e4m3fn),
                                dict(scale_block=64)])
def test_fp8_options_on_a_float_call_are_refused(kw):
    """FP8-only options on a float call (no FP8 inputs, precision=None) are refused by name,
    not ignored."""
    q = jnp.ones((1, 16, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match=next(iter(kw))):
        jaxflash.flash_attention(q, q, q, **kw)
