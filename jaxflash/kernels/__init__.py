"""CuTe DSL kernels (Hopper sm_90a, Blackwell sm_100a), run through `jaxflash.ffi`.

This file stays free of the DSL: it only names the kernels, so runtime-only machines and
``python -m jaxflash.aot`` can find a kernel's DSL-free config and launch description without
importing ``cutlass``. Each entry: (config class, ``launch(config, arch) -> jaxflash.ffi.Launch``,
architectures the kernel is written for).
"""
from __future__ import annotations

KERNELS = {
    # The bridge's own test kernel: out = alpha * x + y.
    "selftest": ("jaxflash.kernels.variants.selftest:SelfTestConfig",
                 "jaxflash.kernels.variants.selftest:selftest_launch", ("sm_90a", "sm_100a")),
    # FlashAttention forward for Hopper.
    "hopper_fwd": ("jaxflash.kernels.variants.fwd:FwdConfig",
                   "jaxflash.kernels.variants.fwd_launch:fwd_launch", ("sm_90a",)),
    # FlashAttention backward for Hopper (dQ, dK, dV; the backend falls back to Pallas otherwise).
    "hopper_bwd": ("jaxflash.kernels.variants.bwd:BwdConfig",
                   "jaxflash.kernels.variants.bwd_launch:bwd_launch", ("sm_90a",)),
}
