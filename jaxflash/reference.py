"""The reference: plain XLA attention with exactly jaxflash's semantics.

It is ``implementation="xla"``, the oracle of every test and the baseline of the benchmarks. It
materializes the T x S logits, so it is for correctness and small problems, not for speed.
Computation is in float32 (float64 for float64 inputs, under x64); output in q's dtype. Mods
(``statics.mods``) are evaluated on the whole index grid by `jaxflash.mods.dense` (vmap of the
user's scalar functions), after the built-in logit transforms; the block mask is an
acceleration structure only and is not read here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash import masking
from jaxflash.mods import dense
from jaxflash._types import AttentionArrays, AttentionStatics, accum_dtype


def attention(q, k, v, arrays: AttentionArrays, statics: AttentionStatics):
    """Canonical-form attention. Returns ``(out [B,T,N,Hv], lse [B,N,T])``, computed and the
    LSE kept in float32 (float64 for float64 inputs: `accum_dtype`).

    A row with no visible key gets output 0 and LSE -inf, with finite gradients (the divisions and
    the log are guarded so no NaN is produced on either pass).
    """
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K
    cd = accum_dtype(q.dtype)
    qf = q.astype(cd).reshape(B, T, K, G, H)
    kf = k.astype(cd)
    vf = v.astype(cd)
    prec = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btkgh,bskh->bkgts", qf, kf, precision=prec).reshape(B, N, T, S)

    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]
    k_idx = jnp.arange(S, dtype=jnp.int32)[None, :]
    slope = None
    if arrays.alibi_slopes is not None:
        slope = arrays.alibi_slopes.astype(cd)[None, :, None, None]
    bias = None if arrays.bias is None else arrays.bias.astype(cd)
    s = masking.transform_logits(s, q_idx, k_idx, scale=statics.scale, softcap=statics.softcap,
                                 alibi_slope=slope, bias=bias)

    mods = statics.mods
    if mods is not None and mods.has_score:
        s = dense.scores(mods, jnp.broadcast_to(s, (B, N, T, S)), arrays.mod_aux,
                         *dense.batch_heads(arrays, B, N), q_idx[:, 0], k_idx[0])

    bcast = lambda x: None if x is None else x[:, None, None, None]  # [B] -> [B,1,1,1]
    q_seg = kv_seg = None
    if arrays.q_segment_ids is not None:
        q_seg = arrays.q_segment_ids[:, None, :, None]
        kv_seg = arrays.kv_segment_ids[:, None, None, :]
    keep = masking.keep(q_idx, k_idx, is_causal=statics.is_causal, window=statics.window,
                        q_seqlen=bcast(arrays.q_seqlen), kv_seqlen=bcast(arrays.kv_seqlen),
                        q_seg=q_seg, kv_seg=kv_seg)
    if mods is not None and mods.has_mask:
        mm = dense.mask(mods, arrays.mod_aux, *dense.batch_heads(arrays, B, N), q_idx[:, 0],
                        k_idx[0])
        keep = mm if keep is None else jnp.logical_and(keep, mm)
    p, lse = masked_softmax(s, keep, arrays.mask)
    out = jnp.einsum("bkgts,bskh->btkgh", p.reshape(B, K, G, T, S), vf, precision=prec)
    out = out.reshape(B, T, N, Hv).astype(q.dtype)
    return out, lse.astype(cd)


def masked_softmax(s, keep=None, mask=None):
    """Softmax over the last axis of logits `s` where `keep` (and the dense `mask`) allow.

    Returns ``(p, lse)``. A row with nothing visible gets p = 0 and lse = -inf, and neither pass
    produces a NaN (the max, the division and the log are guarded).
    """
    if mask is not None:
        keep = mask if keep is None else jnp.logical_and(keep, mask)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]
    return p / l_safe, lse
