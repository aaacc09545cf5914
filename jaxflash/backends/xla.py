"""``implementation="xla"``: the reference; its backward is JAX's VJP of it (recomputed, so no
T x S residual is kept between the passes). Serves every valid call. FP8 calls run the emulated
FP8 path (`jaxflash.fp8.emulated`, the FP8 kernels' numerics contract) instead."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash import reference
from jaxflash._types import accum_dtype
from jaxflash.backends.base import Backend
from jaxflash.fp8 import emulated


# Above this the plan notes the reference's T x S memory (`explain` shows it).
LARGE_SCORES_BYTES = 2**32


class XlaBackend(Backend):
    name = "xla"
    differentiable_backward = True
    reference = True
    shards_mods = True

    def plan(self, problem):
        if problem.statics.fp8 is not None and problem.statics.mods is not None:
            raise NotImplementedError("the emulated FP8 path has no score_mod / mask_mod")
        if problem.statics.fp8 is None and not problem.symbolic:
            scores = problem.batch * problem.num_heads * problem.q_len * problem.kv_len * 4
            if scores > LARGE_SCORES_BYTES:
                # said before it runs: the reference holds every score at once
                return (f"the XLA reference materializes the B x N x T x S float32 scores "
                        f"({scores / 2**30:.0f} GiB, twice that with its gradients)",)
        return None

    def notes(self, detail):
        return detail or ()

    def forward(self, q, k, v, arrays, statics, plan):
        if statics.fp8 is not None:
            return emulated.forward(q, k, v, arrays, statics)
        return reference.attention(q, k, v, arrays, statics)

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        if statics.fp8 is not None:
            return emulated.backward(q, k, v, arrays, statics, out, lse, dout)
        # Like a flash backward, this honours the given (out, lse): they may be the merged result
        # of this block and others (ring attention), out = sum_b exp(lse_b - lse) * out_b. The
        # block's share of the gradient is then the VJP of (out_b, lse_b) with cotangents
        # (w * dout, w * rowsum(dout * (out_b - out))), w = exp(lse_b - lse). For a plain call
        # (out, lse) = (out_b, lse_b): w = 1 and the LSE cotangent vanishes.
        # Floating aux leaves are differentiated; the others (indices) are closed over.
        aux = arrays.mod_aux
        is_f = [jnp.issubdtype(x.dtype, jnp.floating) for x in aux]
        faux = tuple(x for x, f in zip(aux, is_f) if f)

        def f(q, k, v, bias, alibi, faux):
            it = iter(faux)
            full = tuple(next(it) if fl else x for x, fl in zip(aux, is_f))
            arr = arrays._replace(bias=bias, alibi_slopes=alibi, mod_aux=full)
            return reference.attention(q, k, v, arr, statics)

        (out_b, lse_b), vjp = jax.vjp(f, q, k, v, arrays.bias, arrays.alibi_slopes, faux)
        w = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - lse), 0.0)  # [B, N, T]
        w_t = jnp.swapaxes(w, 1, 2)[..., None]  # [B, T, N, 1]
        acc = accum_dtype(q.dtype)
        d32 = dout.astype(acc)
        delta = jnp.sum(d32 * (out_b.astype(acc) - out.astype(acc)), axis=-1)
        dlse = w * jnp.swapaxes(delta, 1, 2)
        dq, dk, dv, dbias, dalibi, dfaux = vjp(((d32 * w_t).astype(out_b.dtype), dlse))
        if statics.mods is None:
            return dq, dk, dv, dbias, dalibi
        # Gradients of aux leaves exist for floating leaves read by a score_mod (a mask has none).
        it = iter(dfaux)
        daux = tuple(next(it) if fl else None for fl in is_f)
        if not statics.mods.has_score:
            daux = tuple(None for _ in daux)
        return dq, dk, dv, dbias, dalibi, daux
