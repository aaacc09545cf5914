"""``implementation="cute"``: the CuTe DSL kernels (Hopper sm_90a, Blackwell sm_100a), run as XLA
FFI custom calls. Not built yet: every call is refused with the reason."""
from __future__ import annotations

from jaxflash.backends.base import Backend


class CuteBackend(Backend):
    name = "cute"

    def check(self, problem):
        raise NotImplementedError(
            "the CuTe DSL kernels are not built yet (issue: bridge and Hopper forward kernel)")

    def __call__(self, q, k, v, arrays, statics, problem):
        self.check(problem)
