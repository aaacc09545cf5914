"""``implementation="xla"``: the reference, differentiated by JAX. Serves every valid call."""
from __future__ import annotations

from jaxflash import reference
from jaxflash.backends.base import Backend


class XlaBackend(Backend):
    name = "xla"

    def check(self, problem):
        return None

    def __call__(self, q, k, v, arrays, statics, problem):
        return reference.attention(q, k, v, arrays, statics)
