"""The emulated FP8 attention: the numerics contract of `jaxflash.fp8.contract`, in plain JAX.

What dispatch runs for an FP8 call when no FP8 kernel can (``implementation="xla"`` for FP8),
on any device, and what the FP8 kernels are tested against. Canonical form (`jaxflash._types`):
q8 ``[B, T, N, H]``, k8 ``[B, S, K, H]``, v8 ``[B, S, K, Hv]`` FP8 with float32 scales in
``arrays.q_scale / k_scale / v_scale`` and the `Fp8Spec` in ``statics.fp8``. Every mask and
logit feature of the float path is served (same `jaxflash.masking` definitions).

Both passes are `lax.scan`s over key tiles (never a T x S tensor beyond one tile's T x 128), so
memory stays O(T x tile) per head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import masking
from jaxflash.fp8 import contract as C

_HP = lax.Precision.HIGHEST
_E4M3 = jnp.float8_e4m3fn
_E5M2 = jnp.float8_e5m2


def _sat(x, dtype):
    m = C.E4M3_MAX if jnp.dtype(dtype) == jnp.dtype(_E4M3) else C.E5M2_MAX
    # The barrier keeps the rounding: with excess precision allowed (its GPU default) XLA
    # simplifies a float32 -> FP8 -> float32 convert pair to nothing, and on the H200 the
    # backward's dO and dS roundings were dropped that way (E4M3 and E5M2 dO gave the same
    # gradients).
    q = lax.optimization_barrier(jnp.clip(x, -m, m).astype(dtype))
    return q.astype(jnp.float32)


def _fq_rows(x, dtype, rows: int, axis: int, amax_axes: tuple[int, ...], floor: float = 0.0):
    """Quantize-dequantize `x` with amax scales per block of `rows` along `axis` (padded), the
    amax taken over that block and `amax_axes` (the amax rule of `jaxflash.quantize`; a
    nonzero amax raised to `floor`, the backward's BWD_AMAX_FLOOR)."""
    L = x.shape[axis]
    n = -(-L // rows)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * rows - L)
    xp = jnp.pad(x, pad)
    shp = xp.shape[:axis] + (n, rows) + xp.shape[axis + 1:]
    xb = xp.reshape(shp)
    red = tuple(a + (1 if a > axis else 0) for a in amax_axes) + (axis + 1,)
    amax = jnp.max(jnp.abs(xb), axis=red, keepdims=True)
    amax = jnp.where(amax > 0, jnp.maximum(amax, jnp.float32(floor)), amax)
    amax = jnp.where(jnp.any(jnp.isnan(xb), axis=red, keepdims=True), jnp.nan, amax)
    fmax = C.E4M3_MAX if jnp.dtype(dtype) == jnp.dtype(_E4M3) else C.E5M2_MAX
    zero = amax == 0
    scale = jnp.where(zero, 1.0, amax / fmax)
    inv = jnp.where(zero, 1.0, fmax / jnp.where(zero, 1.0, amax))
    y = _sat(xb * inv, dtype) * scale
    y = y.reshape(xp.shape)
    return lax.slice_in_dim(y, 0, L, axis=axis)


def _p8(p):
    """The represented P: E4M3 of p * 2^8, read back and divided by 2^8 (exact)."""
    off = jnp.float32(2.0 ** C.P_SCALE_LOG2)
    return _sat(p * off, _E4M3) * (1.0 / off)


def _rows(scale, block: int, L: int):
    """Canonical scale [B, H, nb] -> per row [B, H, L] (row r reads block min(r // block, nb-1))."""
    idx = jnp.minimum(jnp.arange(L) // block, scale.shape[-1] - 1)
    return jnp.take(scale.astype(jnp.float32), idx, axis=-1)


def _split(x, K):                      # [B, T, N, D] -> [B, K, G, T, D]
    B, T, N, D = x.shape
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(B, K, N // K, T, D)


def _merge(x):                         # [B, K, G, T, D] -> [B, T, N, D]
    B, K, G, T, D = x.shape
    return jnp.transpose(x.reshape(B, K * G, T, D), (0, 2, 1, 3))


def _tiles(x, axis: int, tile: int):
    """Split `axis` into tiles (zero padded), tiles first: [n, ...x with axis -> tile...]."""
    L = x.shape[axis]
    n = -(-L // tile)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * tile - L)
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[:axis] + (n, tile) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _untile(x, axis: int, L: int):
    """Inverse of `_tiles` (tiles first -> `axis`, cut to L)."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return lax.slice_in_dim(x, 0, L, axis=axis)


def _operands(q8, k8, v8, arrays, spec):
    """Float32 views: q codes [B,K,G,T,H] and row scales [B,K,G,T]; k codes [B,K,S,H] and
    scales [B,K,S]; dequantized v [B,K,S,Hv]."""
    B, T, N, H = q8.shape
    S, K = k8.shape[1], k8.shape[2]
    qc = _split(q8.astype(jnp.float32), K)
    qs = _rows(arrays.q_scale, spec.q_block, T).reshape(B, K, N // K, T)
    kc = jnp.transpose(k8.astype(jnp.float32), (0, 2, 1, 3))
    ks = _rows(arrays.k_scale, spec.k_block, S)
    vd = (jnp.transpose(v8.astype(jnp.float32), (0, 2, 1, 3))
          * _rows(arrays.v_scale, spec.v_block, S)[..., None])
    return qc, qs, kc, ks, vd


def _dense_tiles(x, K, tile):
    """A dense [Bb, Nb, T, S] bias / mask -> tiles [n, Bb, Kb, Gb, T, tile]."""
    if x is None:
        return None
    Bb, Nb, T, S = x.shape
    x = x.reshape(Bb, K, Nb // K, T, S) if Nb != 1 else x.reshape(Bb, 1, 1, T, S)
    return _tiles(x, 4, tile)


def _logits(cfg, qc, qs, k_t, ks_t, start, bias_t, mask_t):
    """One key tile's logits z [B,K,G,T,tile] (masked -> -inf) and the pre-softcap x (or None).
    cfg: (statics, arrays, T, S, K, tile)."""
    statics, arrays, T, S, K, tile = cfg
    raw = jnp.einsum("bkgth,bksh->bkgts", qc, k_t, precision=_HP)
    s = raw * qs[..., None] * ks_t[:, :, None, None, :]
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]
    k_idx = start + jnp.arange(tile, dtype=jnp.int32)[None, :]
    slope = None
    if arrays.alibi_slopes is not None:
        N = arrays.alibi_slopes.shape[0]
        slope = arrays.alibi_slopes.astype(jnp.float32).reshape(1, K, N // K, 1, 1)
    x = s * statics.scale
    z = masking.transform_logits(s, q_idx, k_idx, scale=statics.scale, softcap=statics.softcap,
                                 alibi_slope=slope, bias=bias_t)
    b5 = lambda a: None if a is None else a[:, None, None, None, None]
    q_seg = kv_seg = None
    if arrays.q_segment_ids is not None:
        q_seg = arrays.q_segment_ids[:, None, None, :, None]
        kv_seg = _seg_tile(arrays.kv_segment_ids, start, tile)[:, None, None, None, :]
    keep = masking.keep(q_idx, k_idx, is_causal=statics.is_causal, window=statics.window,
                        q_seqlen=b5(arrays.q_seqlen), kv_seqlen=b5(arrays.kv_seqlen),
                        q_seg=q_seg, kv_seg=kv_seg)
    inside = k_idx < S
    keep = inside if keep is None else jnp.logical_and(keep, inside)
    if mask_t is not None:
        keep = jnp.logical_and(keep, mask_t)
    z = jnp.where(keep, z, -jnp.inf)
    return z, (x if statics.softcap is not None else None), keep


def _seg_tile(seg, start, tile):
    S = seg.shape[1]
    n = -(-S // tile)
    padded = jnp.pad(seg, ((0, 0), (0, n * tile - S)), constant_values=-1)
    return lax.dynamic_slice_in_dim(padded, start, tile, axis=1)


def forward(q8, k8, v8, arrays, statics):
    """``(out [B,T,N,Hv] spec.out_dtype, lse [B,N,T] float32)`` by the contract's forward."""
    spec = statics.fp8
    B, T, N, _ = q8.shape
    S, K, Hv = k8.shape[1], k8.shape[2], v8.shape[3]
    tile = C.FWD_KV_TILE
    qc, qs, kc, ks, vd = _operands(q8, k8, v8, arrays, spec)
    xs = (_tiles(kc, 2, tile), _tiles(ks, 2, tile), _tiles(vd, 2, tile),
          jnp.arange(-(-S // tile), dtype=jnp.int32) * tile,
          _dense_tiles(arrays.bias, K, tile), _dense_tiles(arrays.mask, K, tile))
    cfg = (statics, arrays, T, S, K, tile)
    shp = (B, K, N // K, T)

    def step(carry, x):
        m, l, acc = carry
        k_t, ks_t, v_t, start, bias_t, mask_t = x
        z, _, _ = _logits(cfg, qc, qs, k_t, ks_t, start, bias_t, mask_t)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(z - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bksd->bkgtd", _p8(p), v_t, precision=_HP)
        return (m_new, l, acc), None

    # carries made `like` q: inside shard_map they then vary over q's mesh axes, as the
    # step's results do (scan requires the carry's type to stay the same)
    like = lambda shape, fill: lax.full_like(qc, fill, jnp.float32, shape)
    init = (like(shp, -jnp.inf), like(shp, 0.0), like(shp + (Hv,), 0.0))
    (m, l, acc), _ = lax.scan(step, init, xs)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = jnp.where(empty[..., None], 0.0, acc / l_safe[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    return (_merge(out).astype(spec.out_dtype), lse.reshape(B, N, T))


def backward(q8, k8, v8, arrays, statics, out, lse, dout):
    """``(dq, dk, dv, dbias, dalibi)`` float32 by the contract's backward: gradients with
    respect to the dequantized q, k, v (and bias / ALiBi slopes when present). Honours a
    given global (out, lse) as ring attention passes them (P is then the global one)."""
    spec = statics.fp8
    B, T, N, H = q8.shape
    S, K, Hv = k8.shape[1], k8.shape[2], v8.shape[3]
    G = N // K
    tile = C.bwd_kv_tile(H)           # the dS blocks' keys (and the scan's tile)
    qc, qs, kc, ks, vd = _operands(q8, k8, v8, arrays, spec)
    qd = qc * qs[..., None]
    do = _split(dout.astype(jnp.float32), K)                               # [B,K,G,T,Hv]
    do8 = _fq_rows(do, jnp.dtype(spec.do_dtype), C.BWD_Q_TILE, axis=3,
                   amax_axes=(4,), floor=C.BWD_AMAX_FLOOR)                # per (b, n, rows)
    # D_i from the quantized dO, as dP; `out` as the forward returned it (the barrier keeps
    # XLA from eliding its rounding to out_dtype, which it may do across a sharded call)
    out = lax.optimization_barrier(out)
    dvec = jnp.sum(do8 * _split(out.astype(jnp.float32), K), axis=-1)    # D_i
    lse_t = lse.astype(jnp.float32).reshape(B, K, G, T)
    lse_safe = jnp.where(jnp.isfinite(lse_t), lse_t, jnp.inf)              # empty rows: p = 0
    xs = (_tiles(kc, 2, tile), _tiles(ks, 2, tile), _tiles(vd, 2, tile),
          jnp.arange(-(-S // tile), dtype=jnp.int32) * tile,
          _dense_tiles(arrays.bias, K, tile), _dense_tiles(arrays.mask, K, tile))
    cfg = (statics, arrays, T, S, K, tile)
    sc = jnp.float32(statics.scale)
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]

    def step(carry, x):
        dq, dalibi = carry
        k_t, ks_t, v_t, start, bias_t, mask_t = x
        z, xs_pre, keep = _logits(cfg, qc, qs, k_t, ks_t, start, bias_t, mask_t)
        p = jnp.where(keep, jnp.exp(z - lse_safe[..., None]), 0.0)
        dv_t = jnp.einsum("bkgts,bkgtd->bksd", _p8(p), do8, precision=_HP)
        dp = jnp.einsum("bkgtd,bksd->bkgts", do8, v_t, precision=_HP)
        dz = p * (dp - dvec[..., None])                                   # at the logits
        dx = dz
        if xs_pre is not None:
            c = statics.softcap
            dx = dz * (1.0 - jnp.square(jnp.tanh(xs_pre / c)))
        ds8 = _fq_rows(dx, _E4M3, C.BWD_DS_Q_TILE, axis=3, amax_axes=(4,),   # (b, n, blk, tile)
                       floor=C.BWD_AMAX_FLOOR)
        kd_t = k_t * ks_t[..., None]
        dq = dq + sc * jnp.einsum("bkgts,bksh->bkgth", ds8, kd_t, precision=_HP)
        dk_t = sc * jnp.einsum("bkgts,bkgth->bksh", ds8, qd, precision=_HP)
        if dalibi is not None:
            k_idx = start + jnp.arange(tile, dtype=jnp.int32)[None, :]
            dist = jnp.abs(q_idx - k_idx).astype(jnp.float32)
            dalibi = dalibi - jnp.sum(dz * dist, axis=(0, 3, 4))
        dbias_t = None
        if bias_t is not None:
            Bb, Kb, Gb = bias_t.shape[:3]
            d = dz if Bb == B else jnp.sum(dz, axis=0, keepdims=True)
            d = d if (Kb, Gb) == (K, G) else jnp.sum(d, axis=(1, 2), keepdims=True)
            dbias_t = d
        return (dq, dalibi), (dk_t, dv_t, dbias_t)

    like = lambda shape: lax.full_like(qc, 0.0, jnp.float32, shape)   # (as the forward's)
    dal0 = None if arrays.alibi_slopes is None else like((K, G))
    (dq, dalibi), (dks, dvs, dbs) = lax.scan(step, (like((B, K, G, T, H)), dal0), xs)
    dk = jnp.transpose(_untile(dks, 2, S), (0, 2, 1, 3))
    dv = jnp.transpose(_untile(dvs, 2, S), (0, 2, 1, 3))
    dbias = None
    if arrays.bias is not None:
        dbias = _untile(dbs, 4, S).reshape(arrays.bias.shape)
    return (_merge(dq), dk, dv, dbias, None if dalibi is None else dalibi.reshape(N))
