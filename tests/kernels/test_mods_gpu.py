"""Score / mask mods in the Hopper kernels (`implementation="cute"`) on an sm_90 GPU: forward,
gradients of q, k, v and of the floating aux arrays, against the float32 reference
(`implementation="xla"` on upcast inputs) on fresh random inputs with odd lengths and GQA.

Every ready-made mod of `jaxflash.mods.library` and two user-written ones; the mask mods also
with a precomputed `BlockMask`, key lengths and the deterministic backward. The mod variants
are pending in `jaxflash.kernels.policy.verified` until this file passes on the H200, so it
runs them with ``JAXFLASH_CUTE_UNVERIFIED=1`` (set here). Their binaries are built on a
machine with the CuTe DSL by ``python -m tests.collect_variants --out DIR -m gpu
tests/kernels/test_mods_gpu.py`` (see /tests/README.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.mods import library as L
from tests.common import FWD_TOL, GRAD_TOL, assert_close, fresh_rng

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _unverified(monkeypatch):
    monkeypatch.setenv("JAXFLASH_CUTE_UNVERIFIED", "1")


def _docs(rng, B, T, n):
    """[B, T] int32 ids of n documents of random lengths per row (sorted, packed)."""
    out = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False))
        out.append(np.searchsorted(cuts, np.arange(T), side="right"))
    return np.stack(out).astype(np.int32)


def _user_score(score, b, h, q_idx, kv_idx, *aux):
    """User-written: a per-key learnable bias, a position-parity bonus and a cap."""
    bias = aux[0][kv_idx]
    bonus = jnp.where((q_idx + kv_idx) % 3 == 0, 0.25, -0.125)
    return 8.0 * jnp.tanh((score + bias + bonus) / 8.0)


def _user_mask(b, h, q_idx, kv_idx, *aux):
    """User-written: block-causal over 48-token chunks, plus every head sees key 0..3."""
    return ((q_idx // 48) >= (kv_idx // 48)) | (kv_idx < 4)


def _cases():
    """(id, T, S, N, K, H, kwargs-maker(rng, B, T, S, N) -> flash_attention kwargs)."""
    return [
        ("causal-mask", 777, 777, 8, 2, 128, lambda r, B, T, S, N: dict(mask_mod=L.causal())),
        ("window-mask", 1000, 1000, 4, 4, 64,
         lambda r, B, T, S, N: dict(mask_mod=L.sliding_window(100, 0))),
        ("chunked", 700, 700, 4, 2, 128, lambda r, B, T, S, N: dict(mask_mod=L.chunked(128))),
        ("document", 900, 900, 8, 2, 128,
         lambda r, B, T, S, N: dict(mask_mod=L.document(), aux=(jnp.asarray(_docs(r, B, T, 5)),))),
        ("prefix-lm", 600, 600, 4, 2, 64,
         lambda r, B, T, S, N: dict(mask_mod=L.prefix_lm(),
                                    aux=(jnp.asarray(r.integers(1, T, B).astype(np.int32)),))),
        ("softcap-causal", 500, 500, 4, 2, 128,
         lambda r, B, T, S, N: dict(score_mod=L.softcap(20.0), is_causal=True)),
        ("alibi-learnable", 513, 513, 8, 2, 64,
         lambda r, B, T, S, N: dict(score_mod=L.alibi(), mask_mod=L.causal(),
                                    aux=(L.alibi_slopes(N),))),
        ("t5-bias", 400, 450, 4, 4, 128,
         lambda r, B, T, S, N: dict(score_mod=L.t5_bias(),
                                    aux=(jnp.asarray(r.standard_normal((32, N)).astype(
                                        np.float32)),))),
        ("user-score", 333, 333, 4, 2, 128,
         lambda r, B, T, S, N: dict(score_mod=_user_score, aux=(jnp.asarray(
             r.standard_normal(S).astype(np.float32)),))),
        ("user-mask", 300, 333, 4, 1, 64, lambda r, B, T, S, N: dict(mask_mod=_user_mask)),
        # ties of jnp.round (half to even) on every odd key-query distance
        ("round-ties", 301, 300, 4, 2, 64, lambda r, B, T, S, N: dict(
            score_mod=lambda s, b, h, q, k: s + 0.25 * jnp.round((k - q) * 0.5) / 64.0)),
    ]


def _check(B, T, S, N, K, H, kw, dtype="bfloat16"):
    rng = fresh_rng()
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32).astype(dtype))
    k = jnp.asarray(rng.standard_normal((B, S, K, H), np.float32).astype(dtype))
    v = jnp.asarray(rng.standard_normal((B, S, K, H), np.float32).astype(dtype))
    w = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    aux = tuple(kw.pop("aux", ()))
    is_f = [bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in aux]

    def loss(impl, q, k, v, faux, iaux):
        fi, ii = iter(faux), iter(iaux)
        full = tuple(next(fi) if f else next(ii) for f in is_f)
        up = (lambda x: x.astype(jnp.float32)) if impl == "xla" else (lambda x: x)
        out = jaxflash.flash_attention(up(q), up(k), up(v), aux=full, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), out.astype(jnp.float32)

    @jax.jit
    def run(q, k, v, faux, iaux):
        res = []
        for impl in ("cute", "xla"):
            (_, out), g = jax.value_and_grad(lambda *a: loss(impl, *a, iaux),
                                             argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, faux)
            res.append((out, g))
        return res

    faux = tuple(x for x, f in zip(aux, is_f) if f)
    iaux = tuple(x for x, f in zip(aux, is_f) if not f)
    (out, g), (ref, gref) = run(q, k, v, faux, iaux)
    assert_close(out, ref, FWD_TOL[dtype], "out")
    for name, a, b in zip("qkv", g[:3], gref[:3]):
        assert_close(a, b, GRAD_TOL[dtype], f"d{name}")
    for i, (a, b) in enumerate(zip(g[3], gref[3])):
        assert_close(a, b, GRAD_TOL[dtype], f"daux[{i}]")


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_mod_matches_reference(case):
    name, T, S, N, K, H, make = case
    kw = make(fresh_rng(), 2, T, S, N)
    _check(2, T, S, N, K, H, kw)


def test_document_with_block_mask_lengths_and_deterministic():
    """A precomputed BlockMask (its 128 x 128 blocks are the forward's tiles: the kernels read
    it instead of evaluating the mask per call), key lengths, and the deterministic backward
    (its range is not narrowed by the table)."""
    B, T, N, K, H = 2, 1100, 4, 2, 128
    rng = fresh_rng()
    seg = jnp.asarray(_docs(rng, B, T, 8))
    bm = jaxflash.mods.create_block_mask(L.document(), B, 1, T, T, block=(128, 128), aux=(seg,))
    kw = dict(mask_mod=L.document(), aux=(seg,), block_mask=bm,
              key_value_seq_lengths=jnp.array([T, 901], jnp.int32), deterministic=True)
    _check(B, T, T, N, K, H, kw)
