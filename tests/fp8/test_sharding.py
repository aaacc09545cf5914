"""FP8 under batch / head sharding (`jaxflash.sharding`) and ring attention (`jaxflash.ring`) on
the 8 host devices of tests/conftest.py: the scales are partitioned with their operands (no
all-gather), and the sharded / ring results equal the unsharded FP8 call."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash
from jaxflash import quantize as Q
from jaxflash.ring import from_zigzag, to_zigzag


def _mesh(shape, names):
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py forces 8 host devices)")
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_batch_x_heads_sharding_carries_the_scales():
    mesh = _mesh((2, 4), ("data", "model"))
    B, T, N, K, D = 2, 128, 8, 4, 64
    q, w = _x((B, T, N, D), 0), _x((B, T, N, D), 3)
    k, v = _x((B, T, K, D), 1), _x((B, T, K, D), 2)
    q8, qs = Q.quantize(q, block_size=64)               # per block [B, N, 2]
    k8, ks = Q.quantize(k, granularity="head")          # per (batch, head) [B, K]
    v8, vs = Q.quantize(v, granularity="tensor")        # per tensor: replicated

    def f(q8, k8, v8, qs, ks, vs, q, k, v):
        def loss8(qs, ks, vs):
            o = jaxflash.flash_attention(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs,
                                         is_causal=True, scale_block=64)
            return jnp.sum(o.astype(jnp.float32) * w)

        def lossq(q, k, v):
            return jnp.sum(jaxflash.flash_attention(q, k, v, is_causal=True,
                                                    precision="fp8") * w)
        return (jax.value_and_grad(loss8, argnums=(0, 1, 2))(qs, ks, vs),
                jax.value_and_grad(lossq, argnums=(0, 1, 2))(q, k, v))

    args = (q8, k8, v8, qs, ks, vs, q, k, v)
    want = jax.jit(f)(*args)
    sh = lambda *spec: NamedSharding(mesh, P(*spec))
    shards = (sh("data", None, "model"), sh("data", None, "model"), sh("data", None, "model"),
              sh("data", "model", None), sh("data", "model"), sh(),
              sh("data", None, "model"), sh("data", None, "model"), sh("data", None, "model"))
    placed = [jax.device_put(a, s) for a, s in zip(args, shards)]
    compiled = jax.jit(f).lower(*placed).compile()
    got = compiled(*placed)
    # Equal up to float32 summation order (which may flip an FP8 rounding here and there).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(a, b) < 1e-3
    text = compiled.as_text()
    for op in ("all-gather", "all-to-all"):
        assert not re.search(rf"\b{op}(-start)?\(", text), op


def test_ring_carries_the_scales():
    """Zigzag over 2 devices (chunks of 64 rows, scale blocks of 64): per-block q scales are
    sharded with the sequence, k / v scales (per tensor / per head) replicated and passed
    around with their blocks; precision="fp8" quantizes each device's blocks."""
    mesh = _mesh((2,), ("seq",))
    B, T, N, K, D = 1, 256, 2, 1, 64
    q, w = _x((B, T, N, D), 5), _x((B, T, N, D), 6)
    k, v = _x((B, T, K, D), 7), _x((B, T, K, D), 8)
    fw, bk = (lambda x: to_zigzag(x, 2)), (lambda x: from_zigzag(x, 2))
    fws = lambda s: jnp.swapaxes(fw(jnp.swapaxes(s, 1, 2)), 1, 2)   # scale blocks, same order
    q8, qs = Q.quantize(q, block_size=64)
    k8, ks = Q.quantize(k, granularity="tensor")
    v8, vs = Q.quantize(v, granularity="head")

    def f(q, k, v, qs, ks, vs):
        def ring8(qs, ks, vs):
            o = jaxflash.ring_attention(fw(q8), fw(k8), fw(v8), q_scale=fws(qs), k_scale=ks,
                                        v_scale=vs, scale_block=64, mesh=mesh, seq_axis="seq",
                                        layout="zigzag", is_causal=True)
            o = bk(o).astype(jnp.float32)
            return jnp.sum(o * o), o   # well conditioned for the scales (no cancellation)

        def plain8(qs, ks, vs):
            o = jaxflash.flash_attention(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs,
                                         scale_block=64, is_causal=True)
            o = o.astype(jnp.float32)
            return jnp.sum(o * o), o

        def ringq(q, k, v):
            o = jaxflash.ring_attention(fw(q), fw(k), fw(v), precision="fp8", scale_block=64,
                                        mesh=mesh, seq_axis="seq", layout="zigzag",
                                        is_causal=True)
            return jnp.sum(bk(o) * w), bk(o)

        def ref(q, k, v):
            o = jaxflash.flash_attention(q, k, v, is_causal=True)
            return jnp.sum(o * w), o

        g = lambda fn, *a: jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)(*a)
        return g(ring8, qs, ks, vs), g(plain8, qs, ks, vs), g(ringq, q, k, v), g(ref, q, k, v)

    ((_, o8), g8), ((_, p8), gp8), ((_, oq), gq), ((_, orf), gr) = jax.jit(f)(q, k, v, qs, ks,
                                                                             vs)
    # FP8 inputs: the ring equals the plain call up to the P rounding of its per-step running
    # max; so do the scales' gradients (of sum(out^2)), within FP8 noise.
    assert _rel(o8, p8) < 0.02
    for what, a, b in zip(("dq_scale", "dk_scale", "dv_scale"), g8, gp8):
        assert _rel(a, b) < 0.05, what
    # precision="fp8": against the float reference, within the FP8 recipe's bounds.
    assert _rel(oq, orf) < 0.08
    for what, a, b in zip(("dq", "dk", "dv"), gq, gr):
        assert _rel(a, b) < 0.12, what


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_padding_past_the_lengths_sets_no_scale(layout):
    """precision="fp8" with sequence lengths: NaN, Inf or huge junk in the masked rows (past
    the query / key lengths) never reaches the valid rows, which share its scale blocks: the
    result equals the call on zeroed padding, for one call and for the ring."""
    mesh = _mesh((2,), ("seq",))
    B, T, N, D = 2, 256, 2, 64
    q, k, v = (_x((B, T, N, D), s) for s in (11, 12, 13))
    lens = jnp.asarray([200, 77], jnp.int32)
    pad = (np.arange(T)[None, :] >= np.asarray(lens)[:, None])[:, :, None, None]
    clean = [np.where(pad, 0.0, x).astype(np.float32) for x in (q, k, v)]
    fw, bk = ((lambda x: to_zigzag(x, 2)), (lambda x: from_zigzag(x, 2))) \
        if layout == "zigzag" else ((lambda x: x), (lambda x: x))
    kw = dict(precision="fp8", query_seq_lengths=lens, key_value_seq_lengths=lens,
              scale_block=64)

    @jax.jit
    def run(q, k, v):
        one = jaxflash.flash_attention(q, k, v, **kw)
        ring = bk(jaxflash.ring_attention(fw(q), fw(k), fw(v), mesh=mesh, seq_axis="seq",
                                          layout=layout, **kw))
        return one, ring

    want_one, want_ring = run(*clean)
    for junk in (np.nan, np.inf, 1e30):
        dirty = [np.where(pad, junk, x).astype(np.float32) for x in clean]
        got_one, got_ring = run(*dirty)
        for got, want in ((got_one, want_one), (got_ring, want_ring)):
            assert bool(jnp.all(jnp.isfinite(got))), junk
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fp8_inside_shard_map():
    """Inside a caller's `shard_map` (its default type checks on): FP8 operands and
    precision="fp8", forward and gradients, equal the unsharded call (the emulated passes'
    scan carries and the Hadamard transform's transpose keep the operands' varying axes)."""
    mesh = _mesh((2, 2), ("b", "h"))
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 4, 32)), jnp.bfloat16) for _ in range(3))
    (q8, qs), (k8, ks), (v8, vs) = (Q.quantize(x, granularity="head") for x in (q, k, v))
    sp, hs = P("b", None, "h"), P("b", "h")
    loss = lambda q, k, v: jnp.sum(jnp.sin(jaxflash.flash_attention(
        q, k, v, precision="fp8", is_causal=True).astype(jnp.float32)))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    part = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(sp,) * 3, out_specs=(sp,) * 3))
    for a, b in zip(part(q, k, v), jax.jit(grad)(q, k, v)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=0, atol=2e-2)
    fp8 = lambda q8, k8, v8, qs, ks, vs: jaxflash.flash_attention(
        q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs)
    part = jax.jit(jax.shard_map(fp8, mesh=mesh, in_specs=(sp,) * 3 + (hs,) * 3,
                                 out_specs=sp))
    np.testing.assert_array_equal(np.asarray(part(q8, k8, v8, qs, ks, vs), np.float32),
                                  np.asarray(jax.jit(fp8)(q8, k8, v8, qs, ks, vs), np.float32))


@pytest.mark.parametrize("gran", ["tensor", "head"])
def test_scale_gradients_on_an_explicit_mesh(gran):
    """On a mesh with Explicit axes (jax.make_mesh's default in newer JAX) the scales'
    gradients of batch-sharded FP8 operands come back with the scales' own (replicated)
    type, equal to the unsharded call's."""
    from jax.sharding import AxisType
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices)")
    mesh = Mesh(np.array(jax.devices()[:4]), ("b",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng()
    ops = [Q.quantize(jnp.asarray(rng.standard_normal((4, 128, 2, 32)), jnp.float32),
                      granularity=gran) for _ in range(3)]
    loss = lambda qs, ks, vs, q8, k8, v8: jnp.sum(jaxflash.flash_attention(
        q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs).astype(jnp.float32) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    x8 = [jax.device_put(x, NamedSharding(mesh, P("b"))) for x, _ in ops]
    sc = [jax.device_put(s, NamedSharding(mesh, P())) for _, s in ops]
    got, want = grad(*sc, *x8), grad(*(s for _, s in ops), *(x for x, _ in ops))
    for g, w in zip(got, want):
        assert g.sharding.spec == P() or all(a is None for a in g.sharding.spec)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4)
