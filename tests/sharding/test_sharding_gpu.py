"""Sharding types on one GPU: a caller's `shard_map` with JAX's varying-axes checks on, and a
mesh with Explicit axes, with the CuTe kernels (FFI calls) and the Pallas kernels (Triton).

A one-device mesh is enough: the axis still types every value (varying over it inside
shard_map, sharded over it in Explicit types), which is what these paths handle; the values
are checked against the float32 reference, forward and gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash
from tests.common import FWD_TOL, GRAD_TOL, Case, assert_close

pytestmark = pytest.mark.gpu

IMPLS = ("cute", "pallas")


def _mesh(explicit):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return Mesh(np.array(jax.devices()[:1]), ("d",), axis_types=(kind,))


def _problem():
    q, k, v, _ = Case(B=2, T=256, S=256, N=4, K=2, H=64, dtype="bfloat16").make()
    w = jax.random.normal(jax.random.key(2), q.shape)
    return q, k, v, w


def _reference(q, k, v, w):
    up = lambda x: x.astype(jnp.float32)
    f = lambda q, k, v: jnp.sum(jaxflash.flash_attention(
        q, k, v, is_causal=True, implementation="xla") * w)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(up(q), up(k), up(v))


def _check(got, want):
    assert_close(got[0], want[0], 10 * FWD_TOL["bfloat16"], "loss")
    for what, g, r in zip(("dq", "dk", "dv"), got[1], want[1]):
        assert_close(g, r, GRAD_TOL["bfloat16"], what)


@pytest.mark.parametrize("impl", IMPLS)
def test_inside_shard_map_with_checks(impl):
    q, k, v, w = _problem()

    def loss(q, k, v):
        body = lambda q, k, v, w: jnp.sum(jaxflash.flash_attention(
            q, k, v, is_causal=True, implementation=impl).astype(jnp.float32) * w)[None]
        f = jax.shard_map(body, mesh=_mesh(False), in_specs=P("d"), out_specs=P("d"))
        return f(q, k, v, w).sum()

    _check(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v), _reference(q, k, v, w))


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_mesh(impl):
    q, k, v, w = _problem()
    mesh = _mesh(True)
    loss = lambda q, k, v: jnp.sum(jaxflash.flash_attention(
        q, k, v, is_causal=True, implementation=impl).astype(jnp.float32) * w)
    args = [jax.device_put(x, NamedSharding(mesh, P("d"))) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    _check(got, _reference(q, k, v, w))
