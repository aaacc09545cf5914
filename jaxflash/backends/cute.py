"""``implementation="cute"``: the CuTe DSL kernels (`jaxflash.kernels`) as XLA FFI custom calls.

Planning (which variant, whether its binary can be had, which backward) lives in
`jaxflash.kernels.plan`; this adapter refuses non-CUDA platforms, runs the plan's launches
(`jaxflash.kernels.call`) and, where the plan has no CuTe backward, runs our Pallas backward on
the CuTe forward's (out, lse) (same math). FP8 calls: the FP8 forward kernel, and the FP8
backward kernel where the plan admits it, else the FP8 contract's emulated backward on the
forward's (out, lse). Score / mask mods are translated into the
kernels (`jaxflash.kernels.variants.mod_program`); what cannot be is refused by the plan with
the primitive's name.
"""
from __future__ import annotations

import dataclasses

from jaxflash._types import GPU_PLATFORMS
from jaxflash.backends.base import Backend


class CuteBackend(Backend):
    name = "cute"
    # the kernels' mods read the shard's (batch, head) offsets (a launch input, zeros
    # unsharded), so calls with mods partition like any other
    shards_mods = True

    def plan(self, problem):
        if problem.platform not in GPU_PLATFORMS:
            raise NotImplementedError(f"CuTe kernels run on CUDA only (platform {problem.platform})")
        if problem.block_sparse is not None and problem.mods is None:
            raise NotImplementedError("a block_mask without a mask_mod")
        from jaxflash.kernels import plan
        detail = plan.plan(problem)
        if detail.bwd is None and not detail.fp8:
            # the backward would be the Pallas kernels'; where they cannot serve the call (a
            # kv head's slice past int32 indexing) the forward still runs, and differentiating
            # it raises with both reasons instead of launching what Pallas refuses
            from jaxflash import pallas_fallback
            try:
                pallas_fallback.check(problem)
            except NotImplementedError as e:
                detail = dataclasses.replace(detail, bwd_reason=(
                    f"{detail.bwd_reason}; the Pallas backward cannot serve it either ({e}): "
                    f"forward only, differentiating it raises"), bwd_refused=True)
        from jaxflash.mods import aux_grad
        note = aux_grad.plan_note(problem)
        if note:
            detail = dataclasses.replace(detail, extra=(note,))
        return detail

    def notes(self, detail):
        return (detail.note,) + detail.extra

    def forward(self, q, k, v, arrays, statics, plan):
        from jaxflash.kernels import call
        if getattr(plan.detail, "fp8", False):
            return call.forward_fp8(plan.detail.fwd, q, k, v, arrays, statics)
        return call.forward(plan.detail.fwd, q, k, v, arrays, statics)

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        if getattr(plan.detail, "fp8", False) and plan.detail.bwd is not None:
            from jaxflash.fp8 import prologue
            from jaxflash.kernels import call
            from jaxflash.kernels.variants.bwd_fp8 import AMAX_FLOOR, DO_SCALE_ROWS
            do8, do_scale = prologue.quantize_rows(dout, plan.detail.bwd.config.do_dtype,
                                                   DO_SCALE_ROWS, AMAX_FLOOR, plan.platform)
            return call.backward_fp8(plan.detail.bwd, q, k, v, arrays, statics, out, lse, dout,
                                     do8, do_scale)
        if getattr(plan.detail, "fp8", False):
            # FP8 gradients by the numerics contract's backward where the kernel does not
            # serve the call (or is gated: `policy.verified`)
            from jaxflash.fp8 import emulated
            return emulated.backward(q, k, v, arrays, statics, out, lse, dout)
        if getattr(plan.detail, "bwd_refused", False):
            raise NotImplementedError(f"no backward for this CuTe call: {plan.detail.bwd_reason}")
        if plan.detail.bwd is None:
            from jaxflash import pallas_fallback
            return pallas_fallback.backward(q, k, v, arrays, statics, out, lse, dout,
                                            interpret=plan.platform == "cpu")
        from jaxflash.kernels import call
        return call.backward(plan.detail.bwd, q, k, v, arrays, statics, out, lse, dout)
