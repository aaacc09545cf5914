"""Gradients of the aux arrays for backends whose kernels return dQ / dK / dV only.

``d aux = sum over (b, h, i, j) of dS[b, h, i, j] * d score_mod(s_ij, b, h, i, j, *aux) / d aux``
with dS = P * (dP - delta) the gradient of the modded logits. Computed in XLA, one chunk of
query rows at a time (`jax.lax.scan`): per chunk it recomputes the raw scores Q Kᵀ and dP =
dO Vᵀ, the logits exactly as the reference builds them (`jaxflash.masking` and the dense mods),
P from the forward's LSE, and takes `jax.vjp` of the score_mod with respect to the floating aux
leaves with dS as cotangent. Cost: two extra matmuls of the backward's size plus the mod and
its VJP over every (query, key) pair (block sparsity is not used here); memory: one chunk of
``B x N x rows x S`` float32 (rows chosen to keep it near 64 MiB).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash import masking
from jaxflash.mods import dense

_CHUNK_ELEMS = 1 << 24   # float32 elements of one chunk's score tile


def plan_note(problem):
    """`explain`'s sentence on how a kernel backend gets the aux gradients of `problem`'s
    mods (None when no aux leaf can have one)."""
    mods = problem.mods
    if mods is None or not mods.has_score or not any(
            d.startswith(("float", "bfloat")) for _, d in mods.aux_avals):
        return None
    return ("aux gradients: XLA, blockwise over query rows (one more Q K^T and dO V^T, the "
            "score_mod's VJP over every pair)")


def needed(statics, arrays) -> bool:
    """Whether any aux leaf can have a gradient (a score_mod and a floating leaf)."""
    mods = statics.mods
    return (mods is not None and mods.has_score
            and any(jnp.issubdtype(x.dtype, jnp.floating) for x in arrays.mod_aux))


def aux_grads(q, k, v, arrays, statics, lse, dout, delta) -> tuple:
    """Cotangents of ``arrays.mod_aux`` (None for non-floating leaves). `lse` ``[B, N, T]`` and
    `delta` ``[B, N, T]`` (rowsum(dO * O)) as the flash backward has them."""
    mods = statics.mods
    aux = arrays.mod_aux
    is_f = [jnp.issubdtype(x.dtype, jnp.floating) for x in aux]
    if not needed(statics, arrays):
        return tuple(None for _ in aux)
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    rows = max(1, min(T, _CHUNK_ELEMS // max(1, B * N * S)))
    nc = -(-T // rows)
    Tp = nc * rows
    pad_t = lambda x, axis: jnp.pad(x, [(0, Tp - T if a == axis else 0) for a in range(x.ndim)])
    qp, dop = pad_t(q, 1), pad_t(dout, 1)
    lsep = pad_t(lse, 2)
    del delta  # recomputed per chunk, exactly (see below)
    bias = None if arrays.bias is None else pad_t(arrays.bias, 2)
    dmask = None if arrays.mask is None else pad_t(arrays.mask, 2)
    qseg = None if arrays.q_segment_ids is None else pad_t(arrays.q_segment_ids, 1)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    prec = jax.lax.Precision.HIGHEST
    k_idx = jnp.arange(S, dtype=jnp.int32)
    bi, hi = dense.batch_heads(arrays, B, N)
    faux = tuple(x for x, f in zip(aux, is_f) if f)

    def full(fa):
        it = iter(fa)
        return tuple(next(it) if f else x for x, f in zip(aux, is_f))

    def chunk(acc, c):
        lo = c * rows
        sl = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, lo, rows, axis)
        qc = sl(qp, 1).astype(jnp.float32).reshape(B, rows, K, G, H)
        qk = jnp.einsum("btkgh,bskh->bkgts", qc, kf, precision=prec).reshape(B, N, rows, S)
        q_idx = lo + jnp.arange(rows, dtype=jnp.int32)
        qi, ki = q_idx[:, None], k_idx[None, :]
        slope = (None if arrays.alibi_slopes is None
                 else arrays.alibi_slopes.astype(jnp.float32)[None, :, None, None])
        s = masking.transform_logits(qk, qi, ki, scale=statics.scale, softcap=statics.softcap,
                                     alibi_slope=slope,
                                     bias=None if bias is None else sl(bias, 2))
        s = jnp.broadcast_to(s, (B, N, rows, S))
        bc = lambda x: None if x is None else x[:, None, None, None]
        keep = masking.keep(
            qi, ki, is_causal=statics.is_causal, window=statics.window,
            q_seqlen=bc(arrays.q_seqlen), kv_seqlen=bc(arrays.kv_seqlen),
            q_seg=None if qseg is None else sl(qseg, 1)[:, None, :, None],
            kv_seg=(None if arrays.kv_segment_ids is None
                    else arrays.kv_segment_ids[:, None, None, :]))
        keep = jnp.broadcast_to(True if keep is None else keep, (B, N, rows, S))
        keep = keep & (qi < T)
        if dmask is not None:
            keep = keep & sl(dmask, 2)
        if mods.has_mask:
            keep = keep & dense.mask(mods, aux, bi, hi, q_idx, k_idx)

        def modded(fa):
            return dense.scores(mods, s, full(fa), bi, hi, q_idx, k_idx)

        sm, vjp = jax.vjp(modded, faux)
        lc = sl(lsep, 2)[..., None]
        p = jnp.where(keep & jnp.isfinite(lc), jnp.exp(sm - jnp.where(jnp.isfinite(lc), lc, 0.0)),
                      0.0)
        # renormalized: the kernel's LSE is a float32 log of its own row sum, and a relative
        # error e in it makes every p of the row e off; dS's row sum, which the exact gradient
        # has at 0, is then e * delta, and a mod whose derivative grows along the row (ALiBi's
        # |i - j|) collects it over every query
        l = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(l > 0, l, 1.0)
        doc = sl(dop, 1).astype(jnp.float32).reshape(B, rows, K, G, -1)
        dp = jnp.einsum("btkgh,bskh->bkgts", doc, vf, precision=prec).reshape(B, N, rows, S)
        # delta = rowsum(P * dP) over the whole row, which this chunk holds: exact, where the
        # kernels' rowsum(dO * O) reads the rounded output (its error is amplified by the
        # cancellation in dP - delta, and a sum over all pairs would collect it).
        delta_c = jnp.sum(p * dp, axis=-1, keepdims=True)
        ds = jnp.where(keep, p * (dp - delta_c), 0.0)
        # dS's row sum is 0 in exact arithmetic; its float32 residue (dp - delta_c cancels)
        # would be collected by a derivative that grows along the row: take it out once more
        ds = ds - p * jnp.sum(ds, axis=-1, keepdims=True)
        (g,) = vjp(ds)
        return tuple(a + b.astype(jnp.float32) for a, b in zip(acc, g)), None

    zero = tuple(jnp.zeros(x.shape, jnp.float32) for x in faux)
    acc, _ = jax.lax.scan(chunk, zero, jnp.arange(nc, dtype=jnp.int32))
    it = iter(acc)
    return tuple(next(it) if f else None for f in is_f)
