"""The launch side of the sm_100a backward at head dim 256, on the CPU: `kernels.call.backward`
runs the two passes ("dv", then "dkdq") with the inputs their launches declare and assembles
dq, dk, dv and d(slopes) from their outputs as it does for one pass.

The kernels are replaced by a float32 model of what each pass writes (`_pass_model`: the
kernel's documented outputs, not its code), so this checks the plumbing (which pass runs, with
which inputs, which outputs it must write and their shapes, lse2 padding, the 64-query
semaphores, the dQ scale and the d(slope) reduction) against `jax.grad` of the reference. The
kernels' own numerics are for the first Blackwell run (`test_sm100_bwd_gpu.py`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import reference
from jaxflash._types import AttentionArrays, AttentionStatics
from jaxflash.kernels import call
from jaxflash.kernels.variants.bwd import ALIBI_PARTS
from jaxflash.kernels.variants.sm100_bwd import TILE_N, Sm100BwdConfig
from jaxflash.kernels.variants.sm100_bwd_launch import output_names, sm100_bwd_launch
from tests.common import randn, rel_l2

pytestmark = pytest.mark.cpu

LOG2_E = math.log2(math.e)


def _pass_model(launch, calls, *inputs, out_shapes, scalars, int_scalars):
    """What the pass `launch` writes, from its inputs (float32): "dv": dv = sum over the GQA
    group of P^T dO; "dkdq": dq_acc = dS K (unscaled), dk = scale sum dS^T Q, per key block
    sums of dS_ij |i - j| in ALiBi part 0, zeroed semaphores."""
    cfg = launch.config
    calls.append(cfg.bwd_pass)
    assert len(inputs) == len(launch.inputs)
    for x, t in zip(inputs, launch.inputs):
        assert str(x.dtype) == t.dtype and x.ndim == len(t.shape)
        for d, (n, want) in enumerate(zip(x.shape, t.shape)):
            assert want is None or n == want
            assert not t.divisibility or not t.divisibility[d] or n % t.divisibility[d] == 0
    q, k, v, do, lse2, delta = (x.astype(jnp.float32) for x in inputs[:6])
    slopes = inputs[6][0] if cfg.has_alibi else None
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    assert lse2.shape[-1] % cfg.tile_m == 0  # the pass's lse2 / delta boxes lie inside
    scale = scalars[0]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btnh,bsnh->bnts", q, kr, precision=hi) * scale
    dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(S)[None, :]).astype(jnp.float32)
    if slopes is not None:
        s = s - slopes[None, :, None, None] * dist
    keep = jnp.ones((T, S), bool)
    if cfg.is_causal:
        keep = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    p = jnp.where(keep, jnp.exp2(s * LOG2_E - lse2[..., :T, None]), 0.0)
    dp = jnp.einsum("btnh,bsnh->bnts", do, vr, precision=hi)
    ds = p * (dp - delta[..., :T, None])
    group = lambda x: x.reshape(B, S, K, G, H).sum(axis=3)
    out = {"dv": group(jnp.einsum("bnts,btnh->bsnh", p, do, precision=hi)),
           "dq_acc": jnp.einsum("bnts,bsnh->btnh", ds, kr, precision=hi),
           "dk": group(jnp.einsum("bnts,btnh->bsnh", ds, q, precision=hi)) * scale}
    if cfg.has_alibi:
        nkb = -(-S // TILE_N)
        pad = nkb * TILE_N - S
        per_key = jnp.pad((ds * dist).sum(axis=2), ((0, 0), (0, 0), (0, pad)))
        blocks = per_key.reshape(B, N, nkb, TILE_N).sum(-1)
        out["alibi_parts"] = jnp.zeros((B, N, nkb, ALIBI_PARTS)).at[..., 0].set(blocks)
    out["dq_sem"] = jnp.zeros((B, N, -(-T // cfg.tile_m)), jnp.int32)
    names = output_names(cfg)
    assert len(names) == len(out_shapes) == len(launch.outputs)
    res = []
    for name, shape in zip(names, out_shapes):
        assert out[name].shape == shape.shape, (name, out[name].shape, shape.shape)
        res.append(out[name].astype(shape.dtype))
    return tuple(res)


@pytest.mark.parametrize("alibi", [False, True])
def test_head_dim_256_backward_runs_both_passes(monkeypatch, alibi):
    B, T, S, N, K, H = 2, 200, 260, 4, 2, 256
    rng = np.random.default_rng(7)
    q = jnp.asarray(randn((B, T, N, H), "bfloat16", rng))
    k = jnp.asarray(randn((B, S, K, H), "bfloat16", rng))
    v = jnp.asarray(randn((B, S, K, H), "bfloat16", rng))
    do = jnp.asarray(randn((B, T, N, H), "bfloat16", rng))
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32) if alibi else None
    statics = AttentionStatics(scale=1.0 / 16, is_causal=True, deterministic=True)
    cfg = Sm100BwdConfig(head_dim=256, is_causal=True, deterministic=True, has_alibi=alibi)
    launch = sm100_bwd_launch(cfg)
    calls = []
    monkeypatch.setattr(call.ffi, "call", lambda l, *a, **kw: _pass_model(l, calls, *a, **kw))

    def kernel_grads(q, k, v, do, slopes):
        arrays = AttentionArrays(alibi_slopes=slopes)
        out, lse = reference.attention(q, k, v, arrays, statics)
        return call.backward(launch, q, k, v, arrays, statics, out, lse, do)

    def ref_grads(q, k, v, do, slopes):
        f = lambda q, k, v, a: reference.attention(q, k, v, AttentionArrays(alibi_slopes=a),
                                                   statics)[0]
        return jax.vjp(f, q, k, v, slopes)[1](do)

    got = jax.jit(kernel_grads)(q, k, v, do, slopes)
    want = jax.jit(ref_grads)(q, k, v, do, slopes)
    assert calls == ["dv", "dkdq"]
    dq, dk, dv, dbias, dslopes = got
    assert dbias is None and (dslopes is None) == (not alibi)
    for name, x, r in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dv, want[2])):
        assert x.shape == r.shape and x.dtype == r.dtype
        err = rel_l2(np.asarray(x, np.float32), np.asarray(r, np.float32))
        assert err < 1e-2, f"{name}: relative L2 error {err:.2e}"
    if alibi:
        err = rel_l2(np.asarray(dslopes), np.asarray(want[3]))
        assert err < 1e-2, f"dslopes: relative L2 error {err:.2e}"
