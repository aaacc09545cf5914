"""precision="fp4" on a compute capability 10.x GPU: whether the sm_100a FP4 Direct-P kernel
may serve a call (`kernel_route`), and the call itself (`forward`).

The kernel is compiled and instruction-checked only (no Blackwell GPU has run it), so it is
gated like every sm_100a variant (`policy.verified`): without ``JAXFLASH_CUTE_UNVERIFIED=1`` the
route is refused with that reason, and `jaxflash.fp4.frontend` then asks for ``emulate=True``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.kernels.policy import verified

_FLOATS = ("float16", "bfloat16", "float32")


def kernel_route(q, k, v, *, is_causal: bool = False, policy: str = "fast",
                 guard=None) -> tuple[bool, str, Optional[object]]:
    """(admitted, why, config) of the FP4 kernel for these arrays (shapes and dtypes only)."""
    from jaxflash.fp4 import constants as C
    from jaxflash.kernels.variants.sm100_fwd_fp4 import Sm100FwdFp4Config, can_implement
    if is_causal:
        return False, ("the causal FP4 path (training: NVFP4 Q/K, FP8 P/V) has no kernel; only "
                       "the non-causal Direct-P forward has one"), None
    if any(np.dtype(x.dtype).name not in _FLOATS for x in (q, k, v)):
        return False, f"the FP4 kernel quantizes {_FLOATS} inputs itself", None
    if q.shape[1] == 0 or k.shape[1] == 0:
        return False, "the FP4 kernel needs at least one query and one key", None
    H, Hv = q.shape[-1], v.shape[-1]
    ok, why = can_implement(head_dim=H, head_dim_v=Hv)
    if not ok:
        return False, f"the sm_100a FP4 kernel cannot serve: {why}", None
    shift = None
    if guard not in (None, False):
        shift = (C.GUARD_DEFAULT_M_L if guard is True else tuple(guard))[1]
    try:
        cfg = Sm100FwdFp4Config(head_dim=H, policy=policy, guard_shift=shift)
    except ValueError as e:
        return False, f"the sm_100a FP4 kernel cannot serve: {e}", None
    pending = verified.pending(cfg)
    if pending and not verified.allowed():
        return False, (f"the sm_100a FP4 kernel {cfg.key} is gated: {', '.join(pending)}; set "
                       f"{verified.ENV}=1 to run it"), cfg
    return True, (f"sm_100a FP4 Direct-P kernel {cfg.key} (compiled and instruction-checked "
                  f"only; admitted by {verified.ENV}=1)"), cfg


def forward(config, q, k, v, *, scale: Optional[float] = None, guard=None,
            return_lse: bool = False):
    """Run the FP4 kernel: out [B, T, N, Hv] in q's dtype (and lse [B, N, T] float32)."""
    from jaxflash import ffi
    from jaxflash.fp4 import constants as C
    from jaxflash.kernels.variants.fwd_fp4_launch import (fp4_kernel_operands,
                                                          sm100_fwd_fp4_launch)
    margin = None
    if guard not in (None, False):
        margin = (C.GUARD_DEFAULT_M_L if guard is True else tuple(guard))[0]
    ins = fp4_kernel_operands(config, q, k, v, scale=scale, guard_margin=margin)
    B, T, N, _ = q.shape
    out_shapes = [jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), jnp.bfloat16),
                  jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    out, lse = ffi.call(sm100_fwd_fp4_launch(config), *ins, out_shapes=out_shapes)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
