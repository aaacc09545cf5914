"""``implementation="pallas"``: our Pallas kernels (`jaxflash.pallas_fallback`).

On GPUs they lower through Pallas' GPU backend, on TPU through Mosaic, on CPU they run in
interpret mode (slow: for tests, never chosen automatically there).
"""
from __future__ import annotations

from jaxflash.backends.base import Backend


class PallasBackend(Backend):
    name = "pallas"

    def check(self, problem):
        from jaxflash import pallas_fallback
        pallas_fallback.check(problem)

    def __call__(self, q, k, v, arrays, statics, problem):
        from jaxflash import pallas_fallback
        return pallas_fallback.attention(q, k, v, arrays, statics,
                                         interpret=problem.platform == "cpu")
