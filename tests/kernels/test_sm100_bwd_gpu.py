"""First Blackwell run of the backward: gradients of `flash_attention(implementation="cute")`
through `FlashBwdSm100` against the float64 NumPy gradient oracle of the Hopper checks
(`devtools.bwd_devrun.np_grads`, its tolerances). Runs only on a GPU of compute capability 10.0
(B200 / GB200), with ``JAXFLASH_CUTE_UNVERIFIED=1`` set by the test (the variants are gated
until this passes); anywhere else it skips with the reason, so on the H200 it refuses cleanly.
It has never run: no Blackwell GPU was available.

Cases: bf16 / fp16, head dims 64 / 128 / 256 (256: the two passes, "dv" then "dkdq"), dense
and causal with GQA (T < S and T > S), a window,
softcap, query / key lengths with empty rows (exact zeros where no key or query is visible),
ALiBi (with d(slopes)), segment ids (packed documents), and the deterministic mode
(bitwise-identical gradients over repeated runs).

On a machine without the CuTe DSL, build the variants first (``python -m jaxflash.aot --arch
sm_100a --out DIR --kernel sm100_bwd ...`` and the forward's, then ``JAXFLASH_KERNEL_DIR=DIR``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.kernels.policy import verified

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devs) and str(getattr(devs[0], "compute_capability", "")) == "10.0"


@pytest.fixture(autouse=True)
def _only_blackwell(monkeypatch):
    if not _blackwell():
        pytest.skip("needs a compute capability 10.0 GPU (B200 / GB200): sm_100a kernels")
    monkeypatch.setenv(verified.ENV, "1")


# (name, dtype, (B, T, S, N, K, H), call kwargs)
CASES = [
    ("bf16 h128 dense gqa", "bfloat16", (2, 1000, 1000, 8, 2, 128), {}),
    ("bf16 h128 causal gqa T<S", "bfloat16", (2, 500, 700, 8, 2, 128), {"is_causal": True}),
    ("bf16 h64 causal T>S", "bfloat16", (2, 700, 300, 4, 4, 64), {"is_causal": True}),
    ("fp16 h64 dense odd", "float16", (3, 129, 77, 2, 1, 64), {}),
    ("bf16 h128 softcap causal", "bfloat16", (2, 500, 500, 4, 2, 128),
     {"is_causal": True, "softcap": 20.0}),
    ("bf16 h128 window", "bfloat16", (2, 800, 800, 4, 2, 128),
     {"local_window_size": (100, 37)}),
    ("fp16 h128 lengths empty rows", "float16", (3, 300, 400, 4, 2, 128),
     {"query_seq_lengths": [300, 131, 0], "key_value_seq_lengths": [400, 0, 255]}),
    ("bf16 h128 deterministic causal", "bfloat16", (2, 1024, 1024, 8, 2, 128),
     {"is_causal": True, "deterministic": True}),
    ("bf16 h64 alibi causal gqa", "bfloat16", (2, 600, 600, 4, 2, 64),
     {"is_causal": True, "alibi_slopes": [0.25, 0.0625, 0.015625, 0.00390625]}),
    # packed documents (sorted ids, boundaries inside blocks; the last query segment, 650-699,
    # has no key: its dq rows are exactly 0)
    ("bf16 h128 segments causal", "bfloat16", (2, 700, 700, 4, 2, 128),
     {"is_causal": True, "segments": ([0, 150, 400, 650], [0, 150, 400, 700])}),
    # head dim 256: two launches ("dv"; "dkdq" with 64-query steps and dQ^T = K^T dS^T)
    ("bf16 h256 causal gqa T<S", "bfloat16", (2, 500, 700, 4, 2, 256), {"is_causal": True}),
    ("fp16 h256 dense lengths empty rows", "float16", (3, 300, 400, 2, 1, 256),
     {"query_seq_lengths": [300, 131, 0], "key_value_seq_lengths": [400, 0, 255]}),
    ("bf16 h256 deterministic causal", "bfloat16", (1, 1024, 1024, 4, 2, 256),
     {"is_causal": True, "deterministic": True}),
    ("bf16 h256 alibi window gqa", "bfloat16", (2, 600, 600, 4, 2, 256),
     {"local_window_size": (100, 37), "alibi_slopes": [0.25, 0.0625, 0.015625, 0.00390625]}),
    ("bf16 h256 softcap segments", "bfloat16", (2, 700, 700, 2, 2, 256),
     {"softcap": 20.0, "segments": ([0, 150, 400, 650], [0, 150, 400, 700])}),
]
TOL = {"bfloat16": 1e-2, "float16": 2e-3}  # as `devtools.bwd_devrun.TOL`


def _inputs(dtype, shape, seed):
    B, T, S, N, K, H = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    dt = jnp.dtype(dtype)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dt)
    v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dt)
    do = jax.random.normal(ks[3], (B, T, N, H), jnp.float32).astype(dt)
    return q, k, v, do


def _segment_ids(B, T, S, starts):
    """Sorted segment ids from segment start positions: (q ids [B, T], kv ids [B, S])."""
    q_starts, kv_starts = starts
    q = np.searchsorted(np.asarray(q_starts), np.arange(T), side="right") - 1
    kv = np.searchsorted(np.asarray(kv_starts), np.arange(S), side="right") - 1
    return (np.broadcast_to(q, (B, T)).astype(np.int32),
            np.broadcast_to(kv, (B, S)).astype(np.int32))


def _call_kwargs(kw, shape):
    """flash_attention keyword args from a case's (lengths as int32, segments as id arrays)."""
    B, T, S = shape[:3]
    out = {}
    for n, x in kw.items():
        if n.endswith("seq_lengths"):
            out[n] = jnp.asarray(x, jnp.int32)
        elif n == "segments":
            qs, ks = _segment_ids(B, T, S, x)
            out["q_segment_ids"], out["kv_segment_ids"] = jnp.asarray(qs), jnp.asarray(ks)
        else:
            out[n] = x
    return out


def _grads(q, k, v, do, kw):
    """(dq, dk, dv[, d(slopes)]) of the cute path."""
    kw = _call_kwargs(kw, (q.shape[0], q.shape[1], k.shape[1]))
    slopes = kw.pop("alibi_slopes", None)
    if slopes is None:
        f = lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="cute", **kw)
        return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(q, k, v, do)
    f = lambda q, k, v, a: jaxflash.flash_attention(q, k, v, implementation="cute",
                                                    alibi_slopes=a, **kw)
    a = jnp.asarray(slopes, jnp.float32)
    return jax.jit(lambda q, k, v, a, do: jax.vjp(f, q, k, v, a)[1](do))(q, k, v, a, do)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm((x - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].replace(" ", "-"))
def test_sm100_backward_matches_float64(case):
    from devtools.bwd_devrun import np_grads
    name, dtype, shape, kw = case
    B, T, S, N, K, H = shape
    q, k, v, do = _inputs(dtype, shape, seed=len(name))
    ckw = _call_kwargs(kw, shape)
    plan = jaxflash.explain(q, k, v, implementation="cute",
                            **{n: (jnp.asarray(x, jnp.float32) if n == "alibi_slopes" else x)
                               for n, x in ckw.items() if not n.endswith("seq_lengths")})
    assert plan.detail.bwd is not None and plan.detail.bwd.kernel.endswith(":FlashBwdSm100"), \
        plan
    g = [np.asarray(x.astype(jnp.float32)) for x in _grads(q, k, v, do, kw)]
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    qs, kvs = kw.get("query_seq_lengths"), kw.get("key_value_seq_lengths")
    ref = np_grads(f32(q), f32(k), f32(v), f32(do), 1.0 / np.sqrt(H), kw.get("is_causal", False),
                   kw.get("local_window_size"), kw.get("softcap"),
                   None if qs is None else np.asarray(qs), None if kvs is None else np.asarray(kvs),
                   None if "alibi_slopes" not in kw else np.asarray(kw["alibi_slopes"]),
                   *((np.asarray(ckw["q_segment_ids"]), np.asarray(ckw["kv_segment_ids"]))
                     if "segments" in kw else ()))
    assert len(g) == len(ref)
    for nm, x, r in zip(("dq", "dk", "dv", "dslopes"), g, ref):
        assert not np.isnan(x).any(), f"{name}: NaN in {nm}"
        err = _rel(x, r)
        assert err < TOL[dtype], f"{name}: {nm} relative L2 error {err:.3e} >= {TOL[dtype]:.0e}"
    if qs is not None:  # rows past q_seqlen: exactly zero dq
        dead = np.arange(T)[None, :] >= np.asarray(qs)[:, None]
        assert np.abs(g[0][dead]).max() == 0.0
    if kvs is not None:  # keys past kv_seqlen: exactly zero dk, dv
        dead = np.arange(S)[None, :] >= np.asarray(kvs)[:, None]
        assert np.abs(g[1][dead]).max() == 0.0 and np.abs(g[2][dead]).max() == 0.0
    if "segments" in kw:  # queries whose segment meets no key: exactly zero dq
        qs_, ks_ = np.asarray(ckw["q_segment_ids"]), np.asarray(ckw["kv_segment_ids"])
        dead = ~(qs_[:, :, None] == ks_[:, None, :]).any(-1)
        assert dead.any() and np.abs(g[0][dead]).max() == 0.0
    if kw.get("deterministic"):  # ordered dQ adds: bitwise the same every run
        for _ in range(3):
            again = [np.asarray(x.astype(jnp.float32)) for x in _grads(q, k, v, do, kw)]
            for a, b in zip(g, again):
                assert np.array_equal(a, b), f"{name}: not bitwise reproducible"
