"""Emulated FP4 training attention (paper section 8), in plain JAX with a ``jax.custom_vjp``.

Forward (causal by default): Q, K in NVFP4 (blocks of 16 along the head dim, E4M3 block scales,
one global factor per (batch, head)); P and V in FP8 E4M3 -- P is the exact online-softmax
probability exp(s - m_running), stored as E4M3(P * 2^8) (``constants.FP8_P_MAX_OFFSET``: E4M3's
top codes), V per (batch, kv head) scaled to E4M3's range.  The denominator is built from the
represented (E4M3) P, like the numerator.  The forward saves the NVFP4 Q/K payload (codes, block
scales, global factors), the E4M3 views of Q/K/V (the projection epilogue's FP8 views), the output
and the float32 LSE -- never a T x S tensor.

Backward: recompute S = Q4 K4^T from the saved NVFP4 payload and P = exp(S - LSE) (float32);
then the five GEMMs with FP8 operands and FP32 accumulation:
  dP = dO8 V8^T,  dV = P8^T dO8,  dS = P * (dP - r),  dQ = scale dS8 K8,  dK = scale dS8^T Q8,
with E4M3 Q8/K8/V8/P8/dS8 and E5M2 dO8; r_i = <O_i, dO_i> from the unquantized dO.  Scales: dO
per (batch, head) tensor amax (E5M2 max 57344), dS per (batch, head, key tile) amax (E4M3 448).
Both passes are ``lax.scan``s over key tiles of 128; GQA sums dK/dV over the query-head group.

MXFP4 P/V ("mxfp4": P quantized per N32 key block from the exact probabilities, V per 32 keys,
OCP rule) diverged in every training run of the paper (MXFP4 arms separate near 0.1 B tokens,
loss 7.01 -> 16.25); it is refused unless ``unstable_mxfp4_pv=True``, and then warns.
"""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash.fp4 import constants as C
from jaxflash.fp4 import formats as F

__all__ = ["fp4_training_attention", "do_flush_fraction", "UnstableFP4Warning"]


class UnstableFP4Warning(UserWarning):
    """MXFP4 P/V in training: diverged in every run of the paper."""


class _Cfg(NamedTuple):
    scale: float
    causal: bool
    pv_format: str
    key_tile: int
    quantize: bool = True      # False: every quantizer is the identity (tests the algebra)


def _fp8_view(x, fmt="e4m3", axes=(2, 3)):
    """Scaled FP8 view per slice over ``axes``: (codes, inverse scale) with x_hat = dec(codes) * inv."""
    enc, fmax = {"e4m3": (F.e4m3_encode, F.E4M3_MAX), "e5m2": (F.e5m2_encode, F.E5M2_MAX)}[fmt]
    amax = F.amax_abs(x, axes)
    s = jnp.where(amax > 0, fmax / jnp.where(amax > 0, amax, 1.0), 1.0)
    return enc(x * s), 1.0 / s


def _fp8_dec(codes, inv, fmt="e4m3"):
    dec = {"e4m3": F.e4m3_decode, "e5m2": F.e5m2_decode}[fmt]
    return dec(codes) * inv


def _p_fp8(p):
    """E4M3 P with the 2^8 offset (exact power-of-two scaling both ways)."""
    off = jnp.float32(2.0 ** C.FP8_P_MAX_OFFSET)
    return F.e4m3_decode(F.e4m3_encode(p * off)) * (1.0 / off)


def _split_heads(x, K):          # [B, T, N, H] -> [B, K, G, T, H]
    Bt, T, N, H = x.shape
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(Bt, K, N // K, T, H)


def _merge_heads(x):             # [B, K, G, T, H] -> [B, T, N, H]
    Bt, K, G, T, H = x.shape
    return jnp.transpose(x.reshape(Bt, K * G, T, H), (0, 2, 1, 3))


def _tiles(x, tile):             # [B, K, S, H] -> [n, B, K, tile, H] (zero padded)
    Bt, K, S, H = x.shape
    n = -(-S // tile)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, n * tile - S), (0, 0)))
    return jnp.moveaxis(x.reshape(Bt, K, n, tile, H), 2, 0)


def _mask(cfg, T, S, start):
    kpos = start + jnp.arange(cfg.key_tile)
    ok = kpos[None, :] < S
    if cfg.causal:
        ok = ok & (kpos[None, :] <= jnp.arange(T)[:, None])
    return ok                                                       # [T, tile]


_HP = lax.Precision.HIGHEST


def _scan_forward(qh, kh, vh, cfg: _Cfg, p_quant):
    """Online-softmax forward over key tiles. qh [B,K,G,T,H], kh [B,K,S,H], vh [B,K,S,Hv]
    (already the represented operands); p_quant maps P to its represented values.
    Returns (o [B,K,G,T,Hv] float32, lse [B,K,G,T])."""
    T, S, Hv = qh.shape[3], kh.shape[2], vh.shape[3]
    tile = cfg.key_tile
    ks, vs = _tiles(kh, tile), _tiles(vh, tile)
    starts = jnp.arange(ks.shape[0]) * tile
    m0 = jnp.full(qh.shape[:-1], -jnp.inf, jnp.float32)
    l0 = jnp.zeros(qh.shape[:-1], jnp.float32)
    a0 = jnp.zeros(qh.shape[:-1] + (Hv,), jnp.float32)

    def step(carry, xs):
        m, l, acc = carry
        k_t, v_t, start = xs
        s = jnp.einsum("bkgth,bksh->bkgts", qh, k_t, precision=_HP) * jnp.float32(cfg.scale)
        s = jnp.where(_mask(cfg, T, S, start), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_rep = p_quant(jnp.exp(s - m_safe[..., None]))
        corr = jnp.exp(m - m_safe)
        l = l * corr + jnp.sum(p_rep, axis=-1)           # denominator from the represented P
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p_rep, v_t, precision=_HP)
        return (m_new, l, acc), None

    (m, l, acc), _ = lax.scan(step, (m0, l0, a0), (ks, vs, starts))
    l_b = lax.optimization_barrier(jnp.broadcast_to(l[..., None], acc.shape))
    return acc / l_b, m + jnp.log(l)


def _forward(q, k, v, cfg: _Cfg):
    if not cfg.quantize:
        return _forward_exact(q, k, v, cfg)
    S, K = k.shape[1], k.shape[2]
    qt = _split_heads(q.astype(jnp.float32), K)                     # [B, K, G, T, H]
    kt = jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3))        # [B, K, S, H]
    vt = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))
    q4 = F.nvfp4_quantize(qt, global_axes=(3, 4))                  # per (batch, head) G
    k4 = F.nvfp4_quantize(kt, global_axes=(2, 3))
    q8 = _fp8_view(qt, axes=(3, 4))                                 # epilogue's FP8 views
    k8 = _fp8_view(kt)
    v8 = _fp8_view(vt)
    if cfg.pv_format == "mxfp4":
        pad = (-S) % C.V_BLOCK
        vp = jnp.pad(vt, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v_hat = F.fake_quant_mxfp4(vp, axis=2)[:, :, :S]           # blocks of 32 keys
        p_quant = F.fake_quant_mxfp4                                # per N32 key block
    else:
        v_hat = _fp8_dec(*v8)
        p_quant = _p_fp8
    o, lse = _scan_forward(F.nvfp4_dequantize(q4), F.nvfp4_dequantize(k4), v_hat, cfg, p_quant)
    out = _merge_heads(o).astype(q.dtype)
    return out, (q4, k4, q8, k8, v8, out, lse)


def _scan_backward(cfg, q4h, k4h, q8h, k8h, v8h, out, lse, do, dtypes, p_quant, do_quant,
                   ds_quant):
    qdt, kdt, vdt = dtypes
    Bt, K, G, T, H = q4h.shape
    S = k4h.shape[2]
    do_t = _split_heads(do.astype(jnp.float32), K)                  # [B, K, G, T, Hv]
    o_t = _split_heads(out.astype(jnp.float32), K)
    r = jnp.sum(do_t * o_t, axis=-1)                                # <O_i, dO_i>
    do8h = do_quant(do_t)
    tile = cfg.key_tile
    k4s, k8s, v8s = _tiles(k4h, tile), _tiles(k8h, tile), _tiles(v8h, tile)
    starts = jnp.arange(k4s.shape[0]) * tile
    sc = jnp.float32(cfg.scale)

    def step(dq, xs):
        k4_t, k8_t, v8_t, start = xs
        s = jnp.einsum("bkgth,bksh->bkgts", q4h, k4_t, precision=_HP) * sc   # recompute QK^T
        p = jnp.where(_mask(cfg, T, S, start), jnp.exp(s - lse[..., None]), 0.0)
        p8 = p_quant(p)
        dv_t = jnp.einsum("bkgts,bkgtd->bksd", p8, do8h, precision=_HP)
        dp = jnp.einsum("bkgtd,bksd->bkgts", do8h, v8_t, precision=_HP)
        ds8 = ds_quant(p * (dp - r[..., None]))
        dq = dq + sc * jnp.einsum("bkgts,bksh->bkgth", ds8, k8_t, precision=_HP)
        dk_t = sc * jnp.einsum("bkgts,bkgth->bksh", ds8, q8h, precision=_HP)
        return dq, (dk_t, dv_t)

    dq0 = jnp.zeros((Bt, K, G, T, H), jnp.float32)
    dq, (dks, dvs) = lax.scan(step, dq0, (k4s, k8s, v8s, starts))

    def untile(x):                                                  # [n, B, K, tile, D] -> [B, S, K, D]
        x = jnp.moveaxis(x, 0, 2).reshape(Bt, K, -1, x.shape[-1])[:, :, :S]
        return jnp.transpose(x, (0, 2, 1, 3))

    return _merge_heads(dq).astype(qdt), untile(dks).astype(kdt), untile(dvs).astype(vdt)


def _backward(cfg: _Cfg, res, do, dtypes):
    if not cfg.quantize:
        return _backward_exact(cfg, res, do, dtypes)
    q4, k4, q8, k8, v8, out, lse = res
    return _scan_backward(
        cfg, F.nvfp4_dequantize(q4), F.nvfp4_dequantize(k4), _fp8_dec(*q8), _fp8_dec(*k8),
        _fp8_dec(*v8), out, lse, do, dtypes, _p_fp8,
        lambda d: _fp8_dec(*_fp8_view(d, "e5m2", axes=(3, 4)), "e5m2"),   # E5M2 dO per head
        lambda d: _fp8_dec(*_fp8_view(d, "e4m3", axes=(3, 4))))           # E4M3 dS per tile


class _Ident(NamedTuple):
    """Stands in for a quantized payload when cfg.quantize is False."""
    x: jax.Array


def _forward_exact(q, k, v, cfg):
    """The same scan with every quantizer replaced by the identity (float32 throughout)."""
    res_q = _split_heads(q.astype(jnp.float32), k.shape[2])
    kt = jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3))
    vt = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))
    o, lse = _scan_forward(res_q, kt, vt, cfg, lambda p: p)
    out = _merge_heads(o).astype(q.dtype)
    return out, (_Ident(res_q), _Ident(kt), _Ident(res_q), _Ident(kt), _Ident(vt), out, lse)


def _backward_exact(cfg, res, do, dtypes):
    q4, k4, _, _, v8, out, lse = res
    return _scan_backward(cfg, q4.x, k4.x, q4.x, k4.x, v8.x, out, lse, do, dtypes,
                          lambda p: p, lambda d: d, lambda d: d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attn(q, k, v, cfg):
    return _forward(q, k, v, cfg)[0]


def _attn_fwd(q, k, v, cfg):
    out, res = _forward(q, k, v, cfg)
    return out, (res, (jnp.zeros((), q.dtype), jnp.zeros((), k.dtype), jnp.zeros((), v.dtype)))


def _attn_bwd(cfg, saved, do):
    res, dtypes = saved
    return _backward(cfg, res, do, tuple(d.dtype for d in dtypes))


_attn.defvjp(_attn_fwd, _attn_bwd)
_attn_jit = jax.jit(_attn, static_argnums=3)


def fp4_training_attention(q, k, v, *, scale: Optional[float] = None, causal: bool = True,
                           pv_format: str = "e4m3", unstable_mxfp4_pv: bool = False,
                           key_tile: int = C.KEY_TILE, _quantize: bool = True):
    """Emulated FP4 training attention: NVFP4 Q/K forward with E4M3 P/V (``pv_format="e4m3"``),
    FP8 backward recomputing P from the saved NVFP4 Q/K and the LSE (see module doc).

    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv]; N a multiple of K; H a multiple of 16.
    Differentiable (``jax.grad``) through a ``jax.custom_vjp``.  ``pv_format="mxfp4"`` raises
    NotImplementedError unless ``unstable_mxfp4_pv=True`` (then an UnstableFP4Warning)."""
    if pv_format not in ("e4m3", "mxfp4"):
        raise ValueError(f"pv_format must be 'e4m3' or 'mxfp4', got {pv_format!r}")
    if pv_format == "mxfp4":
        if not unstable_mxfp4_pv:
            raise NotImplementedError(
                "MXFP4 P/V for training is refused: every MXFP4-P/V training run in the paper "
                "diverged (arms separate near 0.1 B tokens; loss 7.01 -> 16.25 at update 350). "
                "Use pv_format='e4m3' (the paper's stable recipe) or pass unstable_mxfp4_pv=True "
                "to run it anyway, knowing it is unstable.")
        warnings.warn("fp4_training_attention: MXFP4 P/V is UNSTABLE in training (diverged in "
                      "every run of the paper); use it for experiments only.", UnstableFP4Warning,
                      stacklevel=2)
    if q.shape[3] % C.QK_BLOCK:
        raise ValueError(f"head dim must be a multiple of {C.QK_BLOCK} for NVFP4 Q/K")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if key_tile % C.P_BLOCK:
        raise ValueError(f"key_tile must be a multiple of {C.P_BLOCK}")
    scale = float(1.0 / np.sqrt(q.shape[3])) if scale is None else float(scale)
    return _attn_jit(q, k, v, _Cfg(scale, bool(causal), pv_format, int(key_tile), bool(_quantize)))


def do_flush_fraction(do, fmt: str = "e4m3", *, scale_axes=None) -> jax.Array:
    """Fraction of the non-zero dO values that an FP8 cast flushes to zero, with the recipe's
    amax scaling (per tensor by default, or per slice over ``scale_axes``): s = fmt_max / amax,
    flushed = (decode(encode(dO * s)) == 0) & (dO != 0).  Paper: ~97 % for E4M3, ~14 % for E5M2
    on a real checkpoint's dO."""
    x = jnp.asarray(do).astype(jnp.float32)
    codes, inv = _fp8_view(x, fmt, axes=scale_axes)
    dec = {"e4m3": F.e4m3_decode, "e5m2": F.e5m2_decode}[fmt]
    nz = x != 0
    flushed = (dec(codes) == 0) & nz
    return jnp.sum(flushed) / jnp.maximum(jnp.sum(nz), 1)
