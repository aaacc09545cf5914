"""``implementation="pallas"``: our Pallas kernels (`jaxflash.pallas_fallback`).

On GPUs they lower through Pallas' GPU backend, on TPU through Mosaic, on CPU they run in
interpret mode (slow: for tests, never chosen automatically there).
"""
from __future__ import annotations

from jaxflash.backends.base import Backend


class PallasBackend(Backend):
    name = "pallas"

    def plan(self, problem):
        if problem.statics.fp8 is not None:
            raise NotImplementedError("the Pallas kernels have no FP8 path")
        from jaxflash import pallas_fallback
        pallas_fallback.check(problem)
        return None

    def forward(self, q, k, v, arrays, statics, plan):
        from jaxflash import pallas_fallback
        return pallas_fallback.forward(q, k, v, arrays, statics,
                                       interpret=plan.platform == "cpu")

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        from jaxflash import pallas_fallback
        return pallas_fallback.backward(q, k, v, arrays, statics, out, lse, dout,
                                        interpret=plan.platform == "cpu")
