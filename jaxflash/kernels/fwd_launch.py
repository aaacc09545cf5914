"""How the bridge launches the Hopper forward kernel: its `jaxflash.ffi.Launch` (DSL-free).

Tensors are the canonical jaxflash layouts, row-major: q [B, T, N, H], k [B, S, K, H],
v [B, S, K, Hv], optional q_seqlen / kv_seqlen [B] int32; outputs o [B, T, N, Hv] (q's dtype)
and lse [B, N, T] float32. Only the head dims are fixed by the variant: batch, lengths and head
counts are read from the buffers at run time (dim 0 must stay dynamic for `jax.vmap`). Scalars:
float32 (softmax_scale, softcap) always (softcap ignored without ``has_softcap``); int32
(window_left, window_right) when the config has a window.
"""
from __future__ import annotations

from jaxflash.ffi.variant import Launch, TensorArg
from jaxflash.kernels.config import FLOAT_SCALARS, INT_SCALARS, FwdConfig

KERNEL_REF = "jaxflash.kernels.hopper_fwd:FlashFwdSm90"


def fwd_launch(config: FwdConfig, arch: str = "sm_90a") -> Launch:
    dt = config.dtype
    h, hv = config.head_dim, config.head_dim_v
    inputs = [TensorArg(dt, (None, None, None, h)), TensorArg(dt, (None, None, None, h)),
              TensorArg(dt, (None, None, None, hv))]
    if config.has_q_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    if config.has_kv_seqlen:
        inputs.append(TensorArg("int32", (None,)))
    outputs = (TensorArg(dt, (None, None, None, hv)), TensorArg("float32", (None, None, None)))
    return Launch(kernel=KERNEL_REF, config=config, inputs=tuple(inputs), outputs=outputs,
                  scalars=FLOAT_SCALARS, int_scalars=INT_SCALARS if config.has_window else (),
                  arch=arch)


def fwd_scalars(statics) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(float scalars, int scalars) of a call with `jaxflash._types.AttentionStatics`."""
    softcap = statics.softcap if statics.softcap is not None else 1.0
    ints = tuple(int(w) for w in statics.window) if statics.window is not None else ()
    return (float(statics.scale), float(softcap)), ints
