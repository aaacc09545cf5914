"""The DSL-free parts of ALiBi / segment ids in the CuTe forward (no GPU, no CuTe DSL needed):
the per-block segment summaries the kernel skips blocks by, the launch's input list, the device
check's float64 oracle against the reference, and the cute backend's backward (Pallas) taking
the slopes and segment ids through."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from jaxflash.kernels.variants.fwd import FwdConfig
from jaxflash.kernels.common.segments import block_summaries


def _sorted_ids(rng, B, L, max_docs):
    """Document-packed ids: sorted runs of random lengths (some documents of one token)."""
    out = np.zeros((B, L), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), size=rng.integers(0, max_docs), replace=False))
        out[b] = np.searchsorted(cuts, np.arange(L), side="right") + 10 * b
    return out


def _brute(q_seg, kv_seg, tm, tn):
    """meet[b, m, n]: does any (i, j) of the block pair share a segment."""
    B, T = q_seg.shape
    S = kv_seg.shape[1]
    nm, nn = -(-T // tm), -(-S // tn)
    meet = np.zeros((B, nm, nn), bool)
    for b in range(B):
        eq = q_seg[b][:, None] == kv_seg[b][None, :]
        for m in range(nm):
            for n in range(nn):
                meet[b, m, n] = eq[m * tm:(m + 1) * tm, n * tn:(n + 1) * tn].any()
    return meet


@pytest.mark.parametrize("kind", ["sorted", "sorted_missing", "unsorted"])
@pytest.mark.parametrize("T, S, tm, tn", [(300, 457, 128, 128), (129, 77, 128, 80),
                                           (1000, 1000, 128, 64)])
def test_block_summaries_cover_every_meeting_block(kind, T, S, tm, tn):
    rng = np.random.default_rng()
    B = 3
    if kind == "unsorted":
        q_seg = rng.integers(0, 4, (B, T)).astype(np.int32)
        kv_seg = rng.integers(0, 4, (B, S)).astype(np.int32)
    else:
        q_seg = _sorted_ids(rng, B, T, 8)
        kv_seg = _sorted_ids(rng, B, S, 8)
        if kind == "sorted_missing":  # a query document with no key, ids still sorted
            q_seg, kv_seg = 2 * q_seg, 2 * kv_seg
            q_seg[q_seg == q_seg[:, T // 2:T // 2 + 1]] += 1
    rows, cols = (np.asarray(x) for x in block_summaries(jnp.asarray(q_seg),
                                                         jnp.asarray(kv_seg), tm, tn))
    nm, nn = -(-T // tm), -(-S // tn)
    assert rows.shape == (B, nm, 4) and cols.shape == (B, nn, 2)
    assert rows.dtype == np.int32 and cols.dtype == np.int32
    for b in range(B):
        for m in range(nm):
            blk = q_seg[b, m * tm:(m + 1) * tm]
            assert (rows[b, m, 0], rows[b, m, 1]) == (blk.min(), blk.max())
        for n in range(nn):
            blk = kv_seg[b, n * tn:(n + 1) * tn]
            assert (cols[b, n, 0], cols[b, n, 1]) == (blk.min(), blk.max())
    meet = _brute(q_seg, kv_seg, tm, tn)
    n_idx = np.arange(nn)
    inside = (n_idx >= rows[..., 2:3]) & (n_idx < rows[..., 3:4])
    assert not (meet & ~inside).any(), "a block holding a visible pair would be skipped"
    assert (rows[..., 2] <= rows[..., 3]).all()
    if kind != "unsorted":
        # Sorted ids: the range is exactly the blocks whose id ranges overlap, so the work is
        # the sum of doc^2 (to tile size).
        overlap = ((cols[:, None, :, 0] <= rows[:, :, None, 1])
                   & (cols[:, None, :, 1] >= rows[:, :, None, 0]))
        assert (inside == overlap).all()


def test_packed_documents_visit_about_the_sum_of_squares():
    """8 documents of 512 in 4096 (tiles 128): each query tile visits only its document's 4
    key blocks, 1/8 of the dense work."""
    seg = jnp.asarray(np.repeat(np.arange(8, dtype=np.int32), 512)[None])
    rows, _ = block_summaries(seg, seg, 128, 128)
    rows = np.asarray(rows)
    m = np.arange(32)
    assert (rows[0, :, 2] == (m // 4) * 4).all() and (rows[0, :, 3] == (m // 4) * 4 + 4).all()
    assert (rows[0, :, 3] - rows[0, :, 2]).sum() == 32 * 32 // 8


def test_block_summaries_uniform_pairs_are_exactly_single_segment():
    """The kernel drops the element compare when the four min/max values are equal: then every
    pair of the block shares one segment."""
    rng = np.random.default_rng()
    q_seg = _sorted_ids(rng, 2, 700, 3)
    kv_seg = q_seg.copy()
    rows, cols = (np.asarray(x) for x in block_summaries(jnp.asarray(q_seg),
                                                         jnp.asarray(kv_seg), 128, 128))
    for b in range(2):
        for m in range(rows.shape[1]):
            for n in range(cols.shape[1]):
                vals = {rows[b, m, 0], rows[b, m, 1], cols[b, n, 0], cols[b, n, 1]}
                eq = q_seg[b, m * 128:(m + 1) * 128, None] == kv_seg[b, None, n * 128:(n + 1) * 128]
                if len(vals) == 1:
                    assert eq.all()


def test_block_summaries_refuse_mismatched_batches():
    with pytest.raises(ValueError, match=r"\(2, 5\) and \(3, 5\)"):
        block_summaries(jnp.zeros((2, 5), jnp.int32), jnp.zeros((3, 5), jnp.int32), 128, 128)


def test_fwd_inputs_order_and_shapes():
    from jaxflash.kernels.variants.fwd_launch import fwd_inputs, fwd_launch
    cfg = FwdConfig(head_dim=64, has_kv_seqlen=True, has_alibi=True, has_segments=True)
    B, T, S, N, K = 2, 300, 200, 4, 2
    q = jnp.zeros((B, T, N, 64), jnp.bfloat16)
    k = v = jnp.zeros((B, S, K, 64), jnp.bfloat16)
    ins = fwd_inputs(cfg, q, k, v, kv_seqlen=jnp.array([200, 3], jnp.int32),
                     alibi_slopes=jnp.ones((N,)), q_segment_ids=jnp.zeros((B, T), jnp.int32),
                     kv_segment_ids=jnp.zeros((B, S), jnp.int32))
    launch = fwd_launch(cfg)
    assert len(ins) == len(launch.inputs)
    for x, t in zip(ins, launch.inputs):
        assert str(x.dtype) == t.dtype
        assert len(x.shape) == len(t.shape)
        assert all(d is None or d == s for d, s in zip(t.shape, x.shape))
    assert ins[4].shape == (1, N)
    assert ins[7].shape == (B, 3, 4) and ins[8].shape == (B, 2, 2)
    with pytest.raises(ValueError, match="needs alibi_slopes"):
        fwd_inputs(cfg, q, k, v, kv_seqlen=ins[3])
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(N,\) = \(4,\)"):
        fwd_inputs(cfg, q, k, v, kv_seqlen=ins[3], alibi_slopes=jnp.ones((3,)),
                   q_segment_ids=ins[5], kv_segment_ids=ins[6])


def test_devrun_oracle_matches_the_reference_on_the_new_cases():
    """The float64 oracle `devrun check` validates the kernel with agrees with
    ``implementation="xla"`` on ALiBi (with softcap and window) and segment ids (with lengths
    and causal), including rows whose segment has no key."""
    import jaxflash
    from devtools import devrun
    names = {"fp16 h64 alibi softcap window", "bf16 h128 segments", "bf16 h128 segments causal",
             "bf16 h64 segments random alibi kvlen"}
    cases = [c for c in devrun.CHECKS if c[0] in names]
    assert len(cases) == len(names)
    for name, kw, (B, T, S, N, K, ex) in cases:
        cfg = FwdConfig(**kw)
        T, S = min(T, 200), min(S, 220)  # the cases' features at a CPU-friendly size
        ex = dict(ex)
        for key, L in (("q_segs", T), ("kv_segs", S)):
            if key in ex:  # keep the runs' pattern (incl. the missing segment), cut to L
                ex[key] = [_cut(r, L) for r in ex[key]]
        if "kv_seqlen" in ex:
            ex["kv_seqlen"] = [min(x, S) for x in ex["kv_seqlen"]]
        slopes, q_seg, kv_seg = devrun._alibi_and_segments(ex, B, T, S, N)
        rng = np.random.default_rng()
        q = rng.standard_normal((B, T, N, 16)).astype(np.float32)
        k = rng.standard_normal((B, S, K, 16)).astype(np.float32)
        v = rng.standard_normal((B, S, K, 16)).astype(np.float32)
        scale = 0.3
        o, lse = devrun.np_reference(q, k, v, scale, cfg.is_causal, ex.get("window"),
                                     ex.get("softcap"), None, ex.get("kv_seqlen"), slopes,
                                     q_seg, kv_seg)
        kwargs = dict(scale=scale, is_causal=cfg.is_causal, softcap=ex.get("softcap"),
                      local_window_size=ex.get("window"), alibi_slopes=slopes,
                      q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_residual=True)
        if "kv_seqlen" in ex:
            kwargs["key_value_seq_lengths"] = jnp.asarray(ex["kv_seqlen"], jnp.int32)
        ro, rlse = jaxflash.flash_attention(q, k, v, implementation="xla", **kwargs)
        rlse = np.transpose(np.asarray(rlse), (0, 2, 1))  # the API's [B, T, N] -> [B, N, T]
        np.testing.assert_allclose(np.asarray(ro), o, atol=2e-5, err_msg=name)
        fin = np.isfinite(lse)
        assert (np.isfinite(np.asarray(rlse)) == fin).all(), name
        np.testing.assert_allclose(np.asarray(rlse)[fin], lse[fin], rtol=1e-5, atol=1e-5,
                                   err_msg=name)
        if name == "bf16 h128 segments":
            assert (~fin).any(), f"{name}: expected rows whose segment has no key"


def _cut(runs, L):
    out, left = [], L
    for i, n in runs:
        n = min(n, left)
        if n:
            out.append((i, n))
        left -= n
    if left:
        out[-1] = (out[-1][0], out[-1][1] + left)
    return out


def test_cute_backward_passes_alibi_and_segments_through():
    """The cute backend's backward (Pallas, interpreted on CPU here) gets the slopes and
    segment ids: its gradients equal the reference's."""
    from jaxflash import reference
    from jaxflash._types import AttentionArrays, AttentionStatics, Problem
    from jaxflash.backends.cute import CuteBackend
    from jaxflash.dispatch import Plan
    rng = np.random.default_rng()
    B, T, S, N, K, H = 1, 33, 40, 2, 1, 16
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    q_seg = jnp.asarray(np.repeat([[0, 1, 2]], [10, 13, 10], axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.repeat([[0, 1, 3]], [15, 15, 10], axis=1), jnp.int32)
    arrays = AttentionArrays(alibi_slopes=jnp.asarray([0.25, 0.06], jnp.float32),
                             q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    statics = AttentionStatics(scale=0.25, is_causal=True)
    problem = Problem.from_arrays(q, k, v, arrays, statics, "cpu")
    out, lse = reference.attention(q, k, v, arrays, statics)
    dout = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    # A plan without a CuTe backward: the Pallas backward runs on the forward's (out, lse).
    plan = Plan(problem, "cute", (), "cute", detail=types.SimpleNamespace(bwd=None))
    dq, dk, dv, _, dalibi = CuteBackend().backward(q, k, v, arrays, statics, plan, out, lse,
                                                   dout)

    def f(q, k, v, al):
        o, _ = reference.attention(q, k, v, arrays._replace(alibi_slopes=al), statics)
        return jnp.sum(o * dout)

    want = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, arrays.alibi_slopes)
    for name, g, r in zip(("dq", "dk", "dv", "dalibi"), (dq, dk, dv, dalibi), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-4,
                                   err_msg=name)
    # Segment 2 of the queries meets no key: its rows have zero gradient.
    assert np.abs(np.asarray(dq)[:, 23:]).max() == 0.0
