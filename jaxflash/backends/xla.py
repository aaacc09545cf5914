"""``implementation="xla"``: the reference; its backward is JAX's VJP of it (recomputed, so no
T x S residual is kept between the passes). Serves every valid call."""
from __future__ import annotations

import jax

from jaxflash import reference
from jaxflash.backends.base import Backend


class XlaBackend(Backend):
    name = "xla"

    def check(self, problem):
        return None

    def forward(self, q, k, v, arrays, statics, problem):
        return reference.attention(q, k, v, arrays, statics)

    def backward(self, q, k, v, arrays, statics, problem, out, lse, dout):
        def f(q, k, v, bias, alibi):
            arr = arrays._replace(bias=bias, alibi_slopes=alibi)
            return reference.attention(q, k, v, arr, statics)[0]

        _, vjp = jax.vjp(f, q, k, v, arrays.bias, arrays.alibi_slopes)
        return vjp(dout)
