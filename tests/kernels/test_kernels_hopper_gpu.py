"""The Hopper forward kernel through `jaxflash.flash_attention(implementation="cute")` on an
sm_90 GPU, against the float32 reference (fresh random inputs; odd lengths, GQA/MQA, causal with
T != S, windows, softcap, per-batch lengths with empty rows). Skipped without a GPU.

On a machine without the CuTe DSL the variants must be precompiled
(``python -m devtools.devrun build`` / ``python -m jaxflash.aot``, then
``$JAXFLASH_KERNEL_DIR``). The same cases ran on the H200 on 2026-11-30 through
``python -m devtools.devrun check`` (results in benchmarks/results/cute-fwd-h200-*.json).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from tests.common import FWD_TOL, Case, assert_close, assert_forward_close, oracle

pytestmark = pytest.mark.gpu

CASES = [
    Case(B=2, T=1000, S=1000, N=8, K=2, H=128, dtype="bfloat16"),
    Case(B=2, T=777, S=1300, N=4, K=4, H=128, dtype="bfloat16", kwargs=dict(is_causal=True)),
    Case(B=1, T=1300, S=700, N=4, K=2, H=128, dtype="bfloat16", kwargs=dict(is_causal=True)),
    Case(B=2, T=257, S=300, N=6, K=1, H=64, dtype="bfloat16"),
    Case(B=3, T=129, S=77, N=2, K=2, H=64, dtype="float16", kwargs=dict(is_causal=True)),
    Case(B=2, T=333, S=333, N=4, K=4, H=96, dtype="bfloat16"),
    Case(B=1, T=300, S=333, N=4, K=1, H=192, dtype="float16"),
    Case(B=2, T=700, S=700, N=2, K=1, H=256, dtype="bfloat16", kwargs=dict(is_causal=True)),
    Case(B=2, T=500, S=500, N=4, K=2, H=128, dtype="bfloat16",
         kwargs=dict(is_causal=True, softcap=20.0)),
    Case(B=2, T=800, S=800, N=4, K=2, H=128, dtype="bfloat16",
         kwargs=dict(local_window_size=(100, 37))),
    Case(B=2, T=700, S=700, N=4, K=4, H=64, dtype="bfloat16",
         kwargs=dict(is_causal=True, local_window_size=(129, 0))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-h{c.H}-T{c.T}S{c.S}"
                         f"-N{c.N}K{c.K}-{'-'.join(sorted(c.kwargs)) or 'dense'}")
def test_forward_matches_reference(case):
    q, k, v, kw = case.make()
    out, lse = jaxflash.flash_attention(q, k, v, implementation="cute", return_residual=True,
                                        **kw)
    ref_out, ref_lse = oracle(q, k, v, **kw)
    assert_forward_close(out, lse, ref_out, ref_lse, case.dtype)


def test_lengths_with_empty_rows():
    case = Case(B=3, T=300, S=400, N=4, K=2, H=128, dtype="bfloat16")
    q, k, v, _ = case.make()
    kw = dict(query_seq_lengths=jnp.array([300, 131, 17], jnp.int32),
              key_value_seq_lengths=jnp.array([400, 0, 255], jnp.int32))
    out, lse = jaxflash.flash_attention(q, k, v, implementation="cute", return_residual=True,
                                        **kw)
    ref_out, ref_lse = oracle(q, k, v, **kw)
    out = np.asarray(out.astype(jnp.float32))
    lse = np.asarray(lse)
    empty = ~np.isfinite(np.asarray(ref_lse))
    assert empty.any()
    assert np.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all()  # out [B,T,N,H] indexed by the [B,T,N] empty-row mask
    assert_close(out, ref_out, FWD_TOL["bfloat16"], "out")


def _runs(runs):
    return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


def test_alibi_and_segments(causal=True):
    """ALiBi with GQA, packed documents (odd lengths) and a query document with no key (the
    variant of devrun's "bf16 h128 alibi segments causal gqa", so its build covers it)."""
    case = Case(B=2, T=700, S=700, N=8, K=2, H=128, dtype="bfloat16")
    q, k, v, _ = case.make()
    q_seg = jnp.asarray(np.stack([_runs([(0, 1), (1, 300), (2, 129), (3, 270)]),
                                  _runs([(5, 650), (9, 50)])]))
    kv_seg = jnp.asarray(np.stack([_runs([(0, 1), (1, 300), (2, 129), (3, 270)]),
                                   _runs([(5, 650), (6, 50)])]))
    kw = dict(is_causal=causal, alibi_slopes=2.0 ** (-jnp.arange(1, 9, dtype=jnp.float32)),
              q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, lse = jaxflash.flash_attention(q, k, v, implementation="cute", return_residual=True,
                                        **kw)
    ref_out, ref_lse = oracle(q, k, v, **kw)
    out = np.asarray(out.astype(jnp.float32))
    fin = np.isfinite(np.asarray(ref_lse))
    assert (~fin).any()  # batch 1, segment 9: no key
    assert (np.isfinite(np.asarray(lse)) == fin).all()
    assert (out[~fin] == 0).all()
    assert_close(out, ref_out, FWD_TOL["bfloat16"], "out")
    assert_close(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], 1e-4, "lse")
