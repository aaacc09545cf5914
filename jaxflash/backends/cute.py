"""``implementation="cute"``: the CuTe DSL kernels (Hopper sm_90a, Blackwell sm_100a), run as XLA
FFI custom calls. Not built yet: every call is refused with the reason."""
from __future__ import annotations

from jaxflash.backends.base import Backend

_WHY = "the CuTe DSL kernels are not built yet (issue: bridge and Hopper forward kernel)"


class CuteBackend(Backend):
    name = "cute"

    def check(self, problem):
        raise NotImplementedError(_WHY)

    def forward(self, q, k, v, arrays, statics, problem):
        raise NotImplementedError(_WHY)

    def backward(self, q, k, v, arrays, statics, problem, out, lse, dout):
        raise NotImplementedError(_WHY)
