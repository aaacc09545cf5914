"""Entry point for precision="fp4": the JAX emulation (``emulate=True``) or a refusal naming why
the sm_100a kernel cannot serve; ``explain_fp4`` says which and why.

The kernel's own gate and call live above this package (`jaxflash.kernels.fp4_call`, reached
through ``jaxflash.flash_attention(precision="fp4")``): callers pass its verdict as ``kernel``
= (admitted, why), and this module only words the route."""
from __future__ import annotations

from typing import Optional

import jax

from jaxflash.fp4 import constants as C
from jaxflash.fp4.direct_p import direct_p_attention, resolve_policy
from jaxflash.fp4.training import fp4_training_attention

__all__ = ["fp4_attention", "explain_fp4", "has_sm100"]



def has_sm100() -> bool:
    """True if a CUDA device of compute capability 10.x (B200/GB200 sm_100a, B300 sm_103a) is
    visible to JAX."""
    for d in jax.devices():
        cc = getattr(d, "compute_capability", None)
        if d.platform == "gpu" and cc and str(cc).split(".")[0] == "10":
            return True
    return False


def _route(emulate: bool, kernel=None):
    if emulate:
        return "emulated", ("emulate=True: FP4 numerics emulated in JAX (float32 arithmetic on "
                            "bit-exact FP4/FP8 codes); runs on any device; no speed-up")
    if not has_sm100():
        devs = ", ".join(sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}"
                                 for d in jax.devices()}))
        return "refused", (f"precision='fp4' needs an sm_100a (Blackwell) GPU and none is visible "
                           f"({devs}); pass emulate=True to run the JAX emulation")
    if kernel is None:
        return "refused", ("an sm_100a GPU is visible; the FP4 Direct-P kernel is reached through "
                           "jaxflash.flash_attention(precision='fp4'); pass emulate=True to run "
                           "the JAX emulation")
    ok, why = kernel[0], kernel[1]
    if not ok:
        return "refused", f"{why}; pass emulate=True to run the JAX emulation"
    return "kernel", why


def fp4_attention(q, k, v, *, is_causal: bool = False, emulate: bool = False,
                  scale: Optional[float] = None, policy="fast", guard=None,
                  pv_format: str = "e4m3", unstable_mxfp4_pv: bool = False, return_lse=False,
                  kernel=None):
    """precision="fp4" attention.  Non-causal: the Direct-P inference forward
    (``direct_p_attention``).  Causal: the training path (``fp4_training_attention``:
    NVFP4 Q/K, E4M3 P/V, FP8 backward).  It runs only with ``emulate=True``; otherwise
    NotImplementedError naming why the kernel (``kernel``: its gate's verdict, see the module
    doc) cannot serve."""
    route, why = _route(emulate, kernel)
    if route != "emulated":
        raise NotImplementedError(why)
    if is_causal:
        if return_lse:
            raise ValueError("return_lse is only available on the non-causal Direct-P path")
        return fp4_training_attention(q, k, v, scale=scale, causal=True, pv_format=pv_format,
                                      unstable_mxfp4_pv=unstable_mxfp4_pv)
    return direct_p_attention(q, k, v, scale=scale, policy=policy, guard=guard,
                              return_lse=return_lse)


def explain_fp4(q=None, k=None, v=None, *, is_causal: bool = False, emulate: bool = False,
                policy="fast", guard=None, pv_format: str = "e4m3",
                unstable_mxfp4_pv: bool = False, kernel=None) -> str:
    """What ``fp4_attention`` would do for these settings (arrays are optional, only shapes are
    read), as readable text."""
    route, why = _route(emulate, kernel)
    lines = [f"precision='fp4' -> {route}: {why}"]
    if q is not None:
        lines.append(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if is_causal:
        pv = pv_format
        if pv == "mxfp4":
            pv += (" (UNSTABLE: diverged in every training run of the paper)" if unstable_mxfp4_pv
                   else " (REFUSED without unstable_mxfp4_pv=True)")
        lines += ["path: causal training (paper section 8)",
                  "forward: Q/K NVFP4 (16, E4M3 scales, per-head global factor); P/V " + pv,
                  "backward: recompute P from the saved NVFP4 Q/K + LSE; E4M3 Q/K/V/P/dS, E5M2 dO"]
    else:
        pol = resolve_policy(policy)
        g = "off" if guard in (None, False) else (C.GUARD_DEFAULT_M_L if guard is True else guard)
        lines += ["path: Direct-P non-causal inference forward (paper section 4)",
                  "Q/K NVFP4 (16, E4M3, global factor); P/V MXFP4 (32, E8M0); denominator from "
                  "the represented P",
                  f"policy {pol['name']}: A={pol['A']}, B={pol['B']}, anchor rows "
                  f"{pol['anchor_rows']}, native EX2 pair period "
                  f"{pol['native_ex2_pair_period'] or 'none'}, P scale rule {C.P_SCALE_RULE}",
                  f"extreme-logit guard (M, L): {g}"]
    lines.append("honesty: the sm_100a FP4 kernel (non-causal Direct-P forward) is compiled "
                 "and instruction-checked only, gated until a Blackwell run; FP4 numerics are "
                 "emulated in JAX; no Blackwell timing is claimed")
    return "\n".join(lines)
