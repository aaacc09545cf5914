"""Batch / head sharding (`jaxflash.sharding`) on the 8 host devices of tests/conftest.py.

Sharded calls must give the unsharded results and gradients, keep the operands' sharding, and
compile with no all-gather / all-to-all (each shard runs attention on its own slice). A control
backend that XLA cannot partition by itself shows the HLO check can fail.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash
from jaxflash import _vma, autodiff, dispatch, reference, sharding
from jaxflash._types import AttentionArrays, AttentionStatics, Problem
from jaxflash.backends.xla import XlaBackend
from tests.common import (FWD_TOL, GRAD_TOL, Case, assert_close, assert_sum_close, bernoulli,
                          randint, randn)

GATHERS = ("all-gather", "all-to-all")


def _mesh(shape, names, explicit=False):
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py forces 8 host devices)")
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names, axis_types=(kind,) * len(names))


def _collectives(compiled_text):
    return {op: len(re.findall(rf"\b{op}(-start)?\(", compiled_text))
            for op in GATHERS + ("all-reduce", "collective-permute")}


def _loss_fn(kwargs, diff_names, w, aux=False):
    """Loss of (q, k, v, *named optional operands) -> scalar (and the output, with aux); grads
    w.r.t. all of them."""
    def loss(q, k, v, *extra):
        kw = dict(kwargs, **dict(zip(diff_names, extra)))
        out = jaxflash.flash_attention(q, k, v, **kw)
        val = jnp.sum(out.astype(jnp.float32) * w)
        return (val, out) if aux else val
    return loss


SHARDINGS = {
    # name: (mesh shape, axis names, q spec, k/v spec, N, K)
    "batch": ((8,), ("data",), P("data"), P("data"), 4, 2),
    "heads_gqa": ((4,), ("model",), P(None, None, "model"), P(None, None, "model"), 8, 4),
    # 8-way on heads with K = 2: kv heads split over "a", each kv head's group over "b".
    "heads_split_groups": ((2, 4), ("a", "b"), P(None, None, ("a", "b")), P(None, None, "a"),
                           8, 2),
    # MQA: the one kv head is replicated; its query heads are split (dK/dV summed).
    "heads_mqa": ((4,), ("model",), P(None, None, "model"), P(), 8, 1),
    "batch_x_heads": ((2, 4), ("data", "model"), P("data", None, "model"),
                      P("data", None, "model"), 8, 4),
    # The Pallas kernels (interpret mode here) with every optional operand.
    "batch_x_heads_pallas": ((2, 2), ("data", "model"), P("data", None, "model"),
                             P("data", None, "model"), 4, 2),
    # 4-way on 8 query heads with K = 2: a device's heads are half of one kv head's group, a
    # split no plan keeps (JAX has no type for it on Explicit axes): heads run whole.
    "heads_cut_groups": ((4,), ("model",), P(None, None, "model"), P(), 8, 2),
    "heads_cut_groups_pallas": ((4,), ("model",), P(None, None, "model"), P(), 8, 2),
}
GATHERED = ("heads_cut_groups", "heads_cut_groups_pallas")


# Shardy on every layout; GSPMD on the mixed layouts only (time). Explicit axes (sharding in
# types, `jax.make_mesh`'s default) on the layouts that take another path there: the Pallas
# kernels, a cut group, a split group, MQA.
@pytest.mark.parametrize("name,partitioner,explicit", [
    (n, "shardy", False) for n in SHARDINGS if n != "heads_cut_groups_pallas"] + [
    (n, "gspmd", False) for n in ("batch_x_heads", "heads_split_groups")] + [
    (n, "shardy", True) for n in ("batch_x_heads_pallas", "heads_cut_groups",
                                  "heads_cut_groups_pallas", "heads_split_groups", "heads_mqa")])
def test_sharded_equals_unsharded(name, partitioner, explicit):
    impl = "pallas" if name.endswith("pallas") else "xla"
    if impl == "pallas" and _pallas_reason():
        pytest.skip(_pallas_reason())
    shape, axes, qspec, kvspec, N, K = SHARDINGS[name]
    mesh = _mesh(shape, axes, explicit)
    causal = name != "batch"
    case = Case(B=8 if "batch" in name else 2, T=16, S=16, N=N, K=K, H=16,
                kwargs=dict(is_causal=causal, implementation=impl))
    q, k, v, kw = case.make()
    rng = np.random.default_rng(7)  # (NumPy: eager jax.random draws compile per shape)
    B, T, S = case.B, case.T, case.S
    # Every optional operand, with broadcast (size-1) dims where the API allows them.
    bias = randn((1, N, T, S), rng=rng, scale=0.5)
    alibi = jnp.asarray(rng.uniform(0.0, 0.3, (N,)).astype(np.float32))
    mask = bernoulli(0.8, (B, 1, T, S), rng)
    seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.2, axis=1).astype(np.int32))
    kvlen = randint(3, S + 1, (B,), rng)
    kw.update(mask=mask, q_segment_ids=seg, kv_segment_ids=seg, key_value_seq_lengths=kvlen,
              softcap=20.0)
    w = randn((B, T, N, v.shape[-1]), rng=rng)
    # The sharded step also returns the output (aux): its sharding is checked below, and one
    # program is compiled where a separate forward would be a second.
    loss = _loss_fn(kw, ("bias", "alibi_slopes"), w, aux=True)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    try:
        ref_step = jax.value_and_grad(
            _loss_fn(dict(kw, implementation="xla"), ("bias", "alibi_slopes"), w),
            argnums=(0, 1, 2, 3, 4))
        ref_val, ref_grads = jax.jit(ref_step)(q, k, v, bias, alibi)
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (put(q, qspec), put(k, kvspec), put(v, kvspec),
                put(bias, P(None, qspec[2] if len(qspec) > 2 else None)),
                put(alibi, P(qspec[2] if len(qspec) > 2 else None)))
        compiled = step.lower(*args).compile()  # (one compile: called and its HLO read)
        (val, out), grads = compiled(*args)
        text = compiled.as_text()
    finally:
        jax.config.update("jax_use_shardy_partitioner", prev)

    # A scalar sum over the whole output, its partial sums added in another order when sharded:
    # bounded by the terms' magnitude (a relative check failed at 2.1e-5 on fresh inputs).
    assert_sum_close(val, ref_val, np.asarray(out, np.float32) * np.asarray(w), FWD_TOL["float32"],
                     "loss")
    for what, g, r in zip(("dq", "dk", "dv", "dbias", "dalibi"), grads, ref_grads):
        assert_close(g, r, GRAD_TOL["float32"], what)
    same = lambda a, b: tuple(a) + (None,) * (4 - len(a)) == tuple(b) + (None,) * (4 - len(b))
    assert same(grads[0].sharding.spec, qspec), grads[0].sharding
    if name not in GATHERED or explicit:  # (Auto axes: the partitioner places a gathered result)
        assert same(out.sharding.spec, qspec), f"output sharding {out.sharding.spec} != {qspec}"
    counts = _collectives(text)
    assert (name in GATHERED) == any(counts[op] for op in GATHERS), f"{name}: {counts}"


class _Opaque(XlaBackend):
    """The reference behind ops XLA can only run on whole arrays (a sort of all elements): an
    unpartitioned call must gather its operands, a partitioned one must not."""

    name = "opaque"
    differentiable_backward = False   # a kernel's stand-in: custom_vjp and the partitioning op

    def forward(self, q, k, v, arrays, statics, plan):
        touch = lambda x: x + 0.0 * jnp.sort(x.reshape(-1))[-1]
        return reference.attention(touch(q), touch(k), touch(v), arrays, statics)


@pytest.mark.parametrize("partitioned", [True, False])
def test_hlo_check_can_fail(partitioned, monkeypatch):
    mesh = _mesh((2, 4), ("data", "model"))
    if not partitioned:
        monkeypatch.setattr(sharding, "_wanted", lambda *xs: False)
    q, k, v, _ = Case(B=4, T=8, S=8, N=8, K=4, H=8).make()
    statics = AttentionStatics(scale=0.3, is_causal=True)

    def f(q, k, v):
        problem = Problem.from_arrays(q, k, v, AttentionArrays(), statics, "cpu")
        plan = dispatch.Plan(problem, "opaque", (), "opaque")
        return autodiff.attention(_Opaque(), q, k, v, AttentionArrays(), statics, plan)[0]

    spec = NamedSharding(mesh, P("data", None, "model"))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    compiled = jax.jit(f).lower(*args).compile()  # (one compile: called and its HLO read)
    got = compiled(*args)
    ref = jax.jit(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, scale=0.3, is_causal=True, implementation="xla"))(q, k, v)
    assert_close(got, ref, FWD_TOL["float32"], "out")
    counts = _collectives(compiled.as_text())
    assert (counts["all-gather"] == 0) == partitioned, counts


def test_unsharded_calls_are_untouched():
    """One device, eager, or vmap: no custom partitioning in the program at all; and a jaxpr
    holding the op can still be vmapped."""
    q, k, v, _ = Case(B=2, T=8, S=8, N=2, K=2, H=8).make()
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True, implementation="xla")
    text = jax.jit(f).lower(q, k, v).as_text()
    assert "CustomSPMDPartitioning" not in text
    ref = jax.jit(lambda q, k, v: reference.attention(
        q, k, v, AttentionArrays(), AttentionStatics(scale=8 ** -0.5, is_causal=True))[0])(q, k, v)
    assert_close(f(q, k, v), ref, FWD_TOL["float32"], "eager")
    batched = jax.jit(lambda q, k, v: jax.vmap(f)(q[None], k[None], v[None])[0])(q, k, v)
    assert_close(batched, ref, FWD_TOL["float32"], "vmap")
    # vmap of an already traced (jitted / checkpointed) call: the op's body is batched.
    loss = lambda q: jnp.sum(jax.vmap(jax.checkpoint(jax.jit(f)))(q, k[None], v[None]) ** 2)
    g = jax.jit(lambda q: jax.grad(loss)(q[None])[0])(q)
    g_ref = jax.jit(jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2)))(q)
    assert_close(g, g_ref, GRAD_TOL["float32"], "grad of vmap of checkpoint of jit")


def _pallas_reason():
    q = jax.ShapeDtypeStruct((2, 16, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 16, 2, 16), jnp.float32)
    try:
        d = jaxflash.explain(q, kv, kv, is_causal=True, implementation="pallas")
    except Exception as e:  # noqa: BLE001 - the fallback is another engineer's work in progress
        return f"pallas backend unavailable: {e}"
    return None if d.backend == "pallas" else str(d)


class _KernelLike(XlaBackend):
    """The reference behind a kernel's calling convention: each pass ends in one call whose
    results carry no varying-axes type of their own (`jaxflash._vma.kernel_call`, as a Pallas
    or FFI call does), and the two passes are paired by the custom_vjp."""

    name = "kernel-like"
    differentiable_backward = False

    def forward(self, q, k, v, arrays, statics, plan):
        run = lambda q, k, v, arrays: XlaBackend.forward(self, q, k, v, arrays, statics, plan)
        return _vma.kernel_call(run, q, k, v, arrays)

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        grads = XlaBackend.backward(self, q, k, v, arrays, statics, plan, out, lse, dout)
        # traced with the checks off, x * 1 drops the type: a kernel's result
        return _vma.kernel_call(lambda *g: jax.tree.map(lambda x: x * 1, g), *grads)


@pytest.mark.parametrize("K", [4, 1])
def test_kernel_passes_inside_shard_map_with_checks(K):
    """A caller's shard_map with JAX's varying-axes checks on (its default): the kernel passes'
    results are typed per device, the cotangents take their primals' types, and with MQA (k, v
    replicated, query heads split) JAX's transpose sums dK / dV over the devices. Forward and
    gradients equal the unsharded call's; without the typing the custom_vjp refuses."""
    mesh = _mesh((4,), ("model",))
    q, k, v, _ = Case(B=2, T=24, S=24, N=8, K=K, H=16).make()
    w = randn(q.shape, rng=np.random.default_rng(3))
    statics = AttentionStatics(scale=0.25, is_causal=True)

    def attend(q, k, v):
        problem = Problem.from_arrays(q, k, v, AttentionArrays(), statics, "cpu")
        plan = dispatch.Plan(problem, "kernel-like", (), "kernel-like")
        return autodiff.attention(_KernelLike(), q, k, v, AttentionArrays(), statics, plan)[0]

    heads = P(None, None, "model")
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads if K > 1 else P(),
                                                         heads if K > 1 else P()),
                            out_specs=heads)
    ref = lambda q, k, v: jaxflash.flash_attention(q, k, v, scale=0.25, is_causal=True,
                                                   implementation="xla")
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    assert_close(jax.jit(sharded)(q, k, v), jax.jit(ref)(q, k, v), FWD_TOL["float32"], "out")
    for what, a, b in zip(("dq", "dk", "dv"), got[1], want[1]):
        assert_close(a, b, GRAD_TOL["float32"], what)


def test_cute_passes_lower_inside_shard_map_with_checks():
    """Lowered for CUDA (no GPU needed): the CuTe kernels' forward and backward inside a
    shard_map with the checks on trace and lower, the custom calls in the program."""
    pytest.importorskip("cutlass", reason="lowering the CuTe kernels needs the DSL")
    mesh = _mesh((2,), ("d",))
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((4, 1024, 4, 128), jnp.bfloat16)

    def f(q, k, v):
        body = lambda q, k, v: jnp.sum(jaxflash.flash_attention(
            q, k, v, is_causal=True).astype(jnp.float32))[None]
        return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(q, k, v).sum()

    with jaxflash.target_platform("cuda"):
        for fn in (f, jax.grad(f, argnums=(0, 1, 2))):
            text = jax.jit(fn).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
            assert "CuteDSL" in text


def test_vmap_over_a_dim_split_on_explicit_axes():
    """jax.vmap over a dim split on Explicit mesh axes: the XLA backend equals the unsharded
    call; the Pallas kernels, which cannot take the split, say so (NotImplementedError)."""
    mesh = _mesh((2,), ("b",), explicit=True)
    q, k, v, _ = Case(B=2, T=16, S=16, N=2, K=2, H=8).make()
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))    # [V, B, T, N, H]
    f = lambda impl: jax.jit(jax.vmap(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, is_causal=True, implementation=impl)))
    want = f("xla")(qs, ks, vs)
    args = [jax.device_put(x, NamedSharding(mesh, P("b"))) for x in (qs, ks, vs)]
    with jax.set_mesh(mesh):
        assert_close(f("xla")(*args), want, FWD_TOL["float32"], "xla")
        if not _pallas_reason():
            with pytest.raises(NotImplementedError, match="vmap over a dim split"):
                f("pallas")(*args)
