"""The one `jax.custom_vjp` for every backend.

The forward saves only q, k, v, the optional operands, out and lse (O(T + S) per head beyond the
inputs), and the backward hands them to the backend's backward. The LSE output carries no
gradient (the public API stops it, as jax.nn does); ring attention, which does need to combine
partial results through their LSE, calls the backends' forward/backward directly with the
global out and lse instead of differentiating through this function.

Both passes go through `jaxflash.sharding`, which partitions them over sharded batch / head dims
under jit (and is a plain call otherwise).
"""
from __future__ import annotations

import functools

import jax

from jaxflash import sharding
from jaxflash._types import AttentionArrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def _attention(backend, q, k, v, arrays, statics, plan):
    return sharding.forward(backend, q, k, v, arrays, statics, plan)


def _fwd(backend, q, k, v, arrays, statics, plan):
    out, lse = sharding.forward(backend, q, k, v, arrays, statics, plan)
    return (out, lse), (q, k, v, arrays, out, lse)


def _bwd(backend, statics, plan, res, cts):
    q, k, v, arrays, out, lse = res
    dout, _ = cts  # the LSE's cotangent is dropped: see the module docstring
    grads = sharding.backward(backend, q, k, v, arrays, statics, plan, out, lse, dout)
    dq, dk, dv, dbias, dalibi = grads[:5]
    # With mods the backend adds the aux leaves' cotangents (None where a leaf has none).
    daux = grads[5] if len(grads) > 5 else (None,) * len(arrays.mod_aux)
    darrays = AttentionArrays(
        bias=None if arrays.bias is None else dbias.astype(arrays.bias.dtype),
        alibi_slopes=None if arrays.alibi_slopes is None else dalibi.astype(jax.numpy.float32),
        mod_aux=tuple(None if g is None else g.astype(x.dtype)
                      for g, x in zip(daux, arrays.mod_aux)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), darrays


_attention.defvjp(_fwd, _bwd)


def attention(backend, q, k, v, arrays, statics, plan):
    """Differentiable ``(out, lse)`` through `backend`'s own forward and backward, both
    following the call's `jaxflash.dispatch.Plan`."""
    return _attention(backend, q, k, v, arrays, statics, plan)
