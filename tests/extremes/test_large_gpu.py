"""Tensors past 2^31 elements and launches past the 65535 grid limit, on a GPU, for the CuTe and
Pallas kernels, forward and backward.

A full float32 reference of a 2.15e9-element attention does not fit beside it, so the check is
row-restricted: the output gradient is nonzero only on the last R query rows. Then dq is zero on
every other row (checked exactly, over the whole tensor: a wrong 64-bit offset would land
there), and the exact float32 reference of those R rows against all keys gives the whole dk and
dv and the R rows of the output and of dq. Each case is one jitted program: kernels,
reference and the error norms, so nothing T x S sized leaves the device.

Skipped without a GPU; `benchmarks/device/run.sh extremes` runs it on the H200. Memory: about
70 GB at the largest shapes.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              # Recording the launches by running these on the CPU would allocate their tens
              # of GB there: `tests.collect_variants --lower` traces them instead.
              pytest.mark.skipif(bool(os.environ.get("JAXFLASH_COLLECT_VARIANTS")),
                                 reason="too large to run while collecting variants")]

R = 64  # query rows with a nonzero output gradient
HI = jax.lax.Precision.HIGHEST


def _rel(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.linalg.norm((x - ref).ravel()) / jnp.maximum(jnp.linalg.norm(ref.ravel()), 1e-30)


def _rows_reference(q, k, v, do_rows, scale, causal):
    """Float32 out rows, dq rows, dk, dv when dO is nonzero only on the last R rows (products
    accumulate in float32 from the bf16 operands: no float32 copy of k or v is made)."""
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    mm = functools.partial(jnp.einsum, precision=HI, preferred_element_type=jnp.float32)
    qr = q[:, T - R:].reshape(B, R, K, G, H)
    dor = do_rows.reshape(B, R, K, G, -1)
    s = mm("brkgh,bskh->bkgrs", qr, k) * scale
    if causal:  # bottom-right aligned, as the API's causal mask
        i = jnp.arange(T - R, T)[:, None] + (S - T)
        s = jnp.where(jnp.arange(S)[None, :] <= i, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = mm("bkgrs,bskh->brkgh", p, v.astype(jnp.float32))
    dp = mm("brkgh,bskh->bkgrs", dor, v)
    delta = jnp.einsum("brkgh,brkgh->bkgr", dor.astype(jnp.float32), out)
    ds = p * (dp - delta[..., None])
    dq = mm("bkgrs,bskh->brkgh", ds, k.astype(jnp.float32)) * scale
    dk = mm("bkgrs,brkgh->bskh", ds, qr.astype(jnp.float32)) * scale
    dv = mm("bkgrs,brkgh->bskh", p, dor.astype(jnp.float32))
    return out.reshape(B, R, N, -1), dq.reshape(B, R, N, H), dk, dv


@functools.partial(jax.jit, static_argnames=("impl", "causal", "shape"))
def _run(seed, *, impl, causal, shape):
    """The kernels' program: fresh inputs, forward and backward."""
    B, T, N, K, H = shape
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, K, H), jnp.bfloat16)
    do_rows = jax.random.normal(kd, (B, R, N, H), jnp.bfloat16)
    do = jnp.zeros((B, T, N, H), jnp.bfloat16).at[:, T - R:].set(do_rows)
    out, vjp = jax.vjp(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, is_causal=causal, implementation=impl), q, k, v)
    dq, dk, dv = vjp(do)
    return (q, k, v, do_rows), (out[:, T - R:], dq, dk, dv)


@functools.partial(jax.jit, static_argnames=("causal",))
def _compare(inputs, results, *, causal):
    """The reference's program (after the kernels' one has released its scratch)."""
    q, k, v, do_rows = inputs
    out, dq, dk, dv = results
    T, H = q.shape[1], q.shape[3]
    r_out, r_dq, r_dk, r_dv = _rows_reference(q, k, v, do_rows, H ** -0.5, causal)
    finite = jnp.all(jnp.isfinite(out)) & jnp.all(jnp.isfinite(dk)) & jnp.all(
        jnp.isfinite(dv)) & jnp.all(jnp.isfinite(dq))
    return dict(out=_rel(out, r_out), dq=_rel(dq[:, T - R:], r_dq),
                dk=_rel(dk, r_dk), dv=_rel(dv, r_dv),
                dq_elsewhere=jnp.max(jnp.abs(dq[:, :T - R].astype(jnp.float32))),
                finite=finite)


def _errors(seed, *, impl, causal, shape):
    inputs, results = _run(seed, impl=impl, causal=causal, shape=shape)
    return _compare(inputs, results, causal=causal)


# (B, T, N, K, H): each of q, out, dq (and k, v at N = K) holds 2^31 + 2^26 elements or more.
BIG = {
    "d128": (1, 262400, 64, 64, 128),
    "d128-gqa8": (1, 262400, 64, 8, 128),
    "d64": (1, 262400, 128, 128, 64),
    "d256": (1, 262400, 32, 32, 256),
}
TOL = dict(out=2e-2, dq=5e-2, dk=5e-2, dv=5e-2)


def _check(errs):
    errs = {k: float(v) for k, v in errs.items()}
    assert errs.pop("finite") == 1.0, errs
    assert errs.pop("dq_elsewhere") == 0.0, "dq nonzero on rows whose output gradient is zero"
    for name, tol in TOL.items():
        assert errs[name] <= tol, f"{name}: relative L2 {errs[name]:.3e} > {tol}"
    return errs


@pytest.mark.parametrize("impl", ["cute", "pallas"])
@pytest.mark.parametrize("name", list(BIG))
def test_past_2_31_elements(impl, name):
    B, T, N, K, H = BIG[name]
    assert B * T * N * H > 2**31
    print(name, impl, _check(_errors(np.random.SeedSequence().entropy % 2**31, impl=impl,
                                         causal=True, shape=BIG[name])))


@pytest.mark.parametrize("impl", ["cute", "pallas"])
def test_batch_past_grid_limit(impl):
    """B = 70000 > 65535: the grids' y/z extents are split, never a launch error."""
    print(impl, _check(_errors(np.random.SeedSequence().entropy % 2**31, impl=impl,
                               causal=False, shape=(70000, 96, 2, 1, 64))))


def test_million_tokens_causal_gqa():
    """One 2^20-token causal sequence, GQA 8:1, D = 128, forward and backward (the default
    dispatch: the CuTe kernels on Hopper). Time and peak memory: benchmarks/long_context.py."""
    print(_check(_errors(np.random.SeedSequence().entropy % 2**31, impl=None, causal=True,
                         shape=(1, 1 << 20, 8, 1, 128))))


def lower_cute_programs():
    """Trace every CuTe program above without running it (`tests.collect_variants --lower`
    records the launches, so the kernels can be built on a machine without a GPU)."""
    shapes = [(s, True, "cute") for s in BIG.values()] + [
        ((70000, 96, 2, 1, 64), False, "cute"), ((1, 1 << 20, 8, 1, 128), True, None)]
    for shape, causal, impl in shapes:
        _run.lower(0, impl=impl, causal=causal, shape=shape)
