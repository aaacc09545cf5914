"""The sharding and ring checks on two GPUs (the `nvidia-h200-x2` device machine).

Same helpers and tolerances as tests/sharding/test_sharding.py and test_ring.py, on 2-device
meshes of real GPUs, with the reference backend and with the Pallas kernels (Triton).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.common import FWD_TOL, GRAD_TOL, Case, assert_close
from tests.sharding.test_ring import _check, _mesh
from tests.sharding.test_sharding import GATHERS, _collectives, _loss_fn

pytestmark = pytest.mark.gpu


# Few cases: every Triton / XLA compile costs device time.
@pytest.mark.parametrize("spec,impl,dtype", [(P("x"), "xla", "float32"),
                                             (P(None, None, "x"), "xla", "float32"),
                                             (P("x", None, None), "pallas", "bfloat16")],
                         ids=["batch-xla", "heads-xla", "batch-pallas"])
def test_batch_or_heads_sharded(spec, impl, dtype):
    mesh = _mesh((2,), ("x",))
    q, k, v, _ = Case(B=2, T=256, S=256, N=4, K=2, H=64, dtype=dtype).make()
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(1), 0.02, (2, 256)).astype(jnp.int32),
                     axis=1)
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    w = jax.random.normal(jax.random.key(2), q.shape[:-1] + (v.shape[-1],))
    step = jax.jit(jax.value_and_grad(_loss_fn(dict(kw, implementation=impl), (), w),
                                      argnums=(0, 1, 2)))
    up = lambda x: x.astype(jnp.float32)
    ref_val, ref_grads = jax.jit(jax.value_and_grad(
        _loss_fn(dict(kw, implementation="xla"), (), w), argnums=(0, 1, 2)))(up(q), up(k), up(v))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    val, grads = step(*args)
    assert_close(val, ref_val, 10 * FWD_TOL[dtype], "loss")
    for what, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, r, GRAD_TOL[dtype], what)
    counts = _collectives(step.lower(*args).compile().as_text())
    assert all(counts[op] == 0 for op in GATHERS), counts


@pytest.mark.parametrize("layout,impl,dtype", [("contiguous", "xla", "float32"),
                                               ("zigzag", "pallas", "bfloat16")])
def test_ring_two_gpus(layout, impl, dtype):
    mesh = _mesh((2,), ("seq",))
    case = Case(B=2, T=512, S=512, N=4, K=2, H=64, dtype=dtype, kwargs=dict(is_causal=True))
    _check(mesh, case, seq_axis="seq", layout=layout, implementation=impl, check_sharding=True)
