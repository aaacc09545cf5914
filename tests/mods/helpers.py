"""Shared pieces of the mods tests: the dtype-faithful reference and the error rule.

The oracle is the float32 reference (``implementation="xla"`` on float32-upcast inputs, aux
in float32), gradients by `jax.grad` of it. For low-precision inputs a kernel is held to
within 1.2x the error of the *dtype-faithful* reference: the same dense attention with the
rounding points of a flash kernel in that dtype (P rounded before P V, dS rounded before the
dS K / dSᵀ Q products, outputs and gradients in the input dtype), so the bound measures the
kernel against what the dtype allows, not against float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import masking
from jaxflash.mods import dense, make_spec
from tests.common import rel_l2


def faithful(q, k, v, *, score_mod=None, mask_mod=None, aux=(), is_causal=False,
             local_window_size=None, scale=None):
    """Dense attention with a flash kernel's rounding points in q's dtype (see the module
    docstring); the mods are evaluated by `jaxflash.mods.dense` like the reference's.
    Its backward is the flash backward, densely: delta = rowsum(dO * O) from the rounded
    output, dS rounded before the dS K and dSᵀ Q products, P rounded before Pᵀ dO."""
    spec, leaves = make_spec(score_mod, mask_mod, aux)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _faithful(q, k, v, leaves, (spec, is_causal, local_window_size, scale))


_PREC = jax.lax.Precision.HIGHEST


def _f32(x):
    return x.astype(jnp.float32)


def _logits(q, k, leaves, st):
    spec, is_causal, window, scale = st
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    qk = jnp.einsum("btkgh,bskh->bkgts", _f32(q).reshape(B, T, K, G, H), _f32(k),
                    precision=_PREC).reshape(B, N, T, S)
    s_pre = qk * scale
    qi, ki, bi, hi = dense.indices(T), dense.indices(S), dense.indices(B), dense.indices(N)

    def modded(s_pre, leaves):
        if spec is None or not spec.has_score:
            return s_pre
        return dense.scores(spec, s_pre, leaves, bi, hi, qi, ki)

    keep = masking.keep(qi[:, None], ki[None, :], is_causal=is_causal, window=window)
    keep = jnp.broadcast_to(True if keep is None else keep, (B, N, T, S))
    if spec is not None and spec.has_mask:
        keep = keep & dense.mask(spec, leaves, bi, hi, qi, ki)
    return s_pre, modded, keep


def _probs(s, keep):
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(l == 0, 1.0, l)


def _pv(p_lo, v, B, K, G, T, S):
    return jnp.einsum("bkgts,bskh->btkgh", p_lo.reshape(B, K, G, T, S), _f32(v),
                      precision=_PREC).reshape(B, T, K * G, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _faithful(q, k, v, leaves, st):
    return _faithful_fwd(q, k, v, leaves, st)[0]


def _faithful_fwd(q, k, v, leaves, st):
    dt = q.dtype
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    s_pre, modded, keep = _logits(q, k, leaves, st)
    p = _probs(modded(s_pre, leaves), keep)
    out = _pv(p.astype(dt).astype(jnp.float32), v, B, K, N // K, T, S).astype(dt)
    return out, (q, k, v, leaves, out)


def _faithful_bwd(st, res, dout):
    q, k, v, leaves, out = res
    dt = q.dtype
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    s_pre, modded, keep = _logits(q, k, leaves, st)
    is_f = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    fl = tuple(x for x, f in zip(leaves, is_f) if f)

    def mod_of(s_pre, fl):
        it = iter(fl)
        return modded(s_pre, tuple(next(it) if f else x for x, f in zip(leaves, is_f)))

    s, vjp = jax.vjp(mod_of, s_pre, fl)
    p = _probs(s, keep)
    p_lo = p.astype(dt).astype(jnp.float32)
    d = _f32(dout)
    delta = jnp.moveaxis(jnp.sum(d * _f32(out), axis=-1), 1, 2)[..., None]   # [B, N, T, 1]
    d5 = d.reshape(B, T, K, G, -1)
    dv = jnp.einsum("bkgts,btkgh->bskh", p_lo.reshape(B, K, G, T, S), d5, precision=_PREC)
    dp = jnp.einsum("btkgh,bskh->bkgts", d5, _f32(v), precision=_PREC).reshape(B, N, T, S)
    ds = jnp.where(keep, p * (dp - delta), 0.0)
    ds_pre, dfl = vjp(ds)
    scale = st[3]
    ds_lo = (ds_pre * scale).astype(dt).astype(jnp.float32).reshape(B, K, G, T, S)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds_lo, _f32(k), precision=_PREC).reshape(q.shape)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds_lo, _f32(q).reshape(B, T, K, G, H),
                    precision=_PREC)
    it = iter(dfl)
    dleaves = tuple(next(it) if f else None for f in is_f)
    return dq.astype(dt), dk.astype(dt), dv.astype(dt), dleaves


_faithful.defvjp(_faithful_fwd, _faithful_bwd)


def check_rule(x, ref, faithful_x, what, floor=1e-6):
    """x (the kernel's) within 1.2x the faithful reference's relative L2 error to ref."""
    x, ref, fx = (np.asarray(a, np.float64) for a in (x, ref, faithful_x))
    assert np.all(np.isfinite(x)), f"{what}: non-finite values"
    err, ferr = rel_l2(x, ref), rel_l2(fx, ref)
    assert err <= 1.2 * ferr + floor, (f"{what}: error {err:.3e} > 1.2 x the dtype-faithful "
                                       f"reference's {ferr:.3e}")
    if __import__("os").environ.get("MODS_PRINT"): print(what, err, ferr)
    return err, ferr
