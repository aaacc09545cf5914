"""``implementation="pallas"``: our Pallas kernels (`jaxflash.pallas_fallback`).

On GPUs they lower through Pallas' GPU backend, on TPU through Mosaic, on CPU they run in
interpret mode (slow: for tests, never chosen automatically there).
"""
from __future__ import annotations

from jaxflash.backends.base import Backend


class PallasBackend(Backend):
    name = "pallas"
    shards_mods = True

    def plan(self, problem):
        if problem.statics.fp8 is not None:
            raise NotImplementedError("the Pallas kernels have no FP8 path")
        from jaxflash import pallas_fallback
        pallas_fallback.check(problem)
        if problem.mods is None:
            return None
        # What `explain` says about a call with mods (the plan is otherwise empty).
        notes = ["mods: score_mod / mask_mod evaluated in the kernels from their jaxprs "
                 f"(key {problem.mods.key[:12]})"]
        from jaxflash.mods import aux_grad
        notes += [n for n in (aux_grad.plan_note(problem),) if n]
        if problem.block_sparse is not None:
            notes.append(f"block mask {problem.block_sparse}: empty tiles skipped, full ones "
                         f"run without the mask_mod")
        return tuple(notes)

    def notes(self, detail):
        return detail or ()

    def forward(self, q, k, v, arrays, statics, plan):
        from jaxflash import pallas_fallback
        return pallas_fallback.forward(q, k, v, arrays, statics,
                                       interpret=plan.platform == "cpu")

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        from jaxflash import pallas_fallback
        return pallas_fallback.backward(q, k, v, arrays, statics, out, lse, dout,
                                        interpret=plan.platform == "cpu")
