"""CuTe DSL kernels (Hopper sm_90a; Blackwell sm_100a, gated), run through `jaxflash.ffi`.

Layout:
- ``sm90/``: the Hopper device kernels and their private parts.
- ``sm100/``: the Blackwell forward and backward (compiled and instruction-checked only; gated in
  ``policy/verified.py`` until a Blackwell run).
- ``common/``: device building blocks every architecture's kernels share (masks, online
  softmax, layouts, pipelines, launch arguments, tile order, segment summaries).
- ``variants/``: the DSL-free configs (what a binary *is*) and launch descriptions.
- ``policy/``: which variant serves a call (``choose``) and which are admitted (``verified``).
- ``plan.py``: a call's kernel plan (forward launch, backward launch or why not);
  ``call.py``: the XLA-side halves around the launches.

This file is the kernel registry: every kernel is named here once, DSL-free, so runtime-only
machines and ``python -m jaxflash.aot`` find a kernel's config, launch description and classes
without importing ``cutlass``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One registered kernel.

    config: ``"module:Class"`` of its frozen, DSL-free config.
    launch: ``"module:function"``, ``(config, arch) -> jaxflash.ffi.Launch``.
    classes: ``(role, "module:Class")`` pairs of the device kernel classes a launch may name.
    archs: architectures the kernel is written for.
    """

    config: str
    launch: str
    classes: tuple[tuple[str, str], ...]
    archs: tuple[str, ...]

    def kernel_class(self, role: str = "main") -> str:
        for r, ref in self.classes:
            if r == role:
                return ref
        raise KeyError(f"no kernel class with role {role!r} (have {[r for r, _ in self.classes]})")


KERNELS: dict[str, Kernel] = {
    # The bridge's own test kernel: out = alpha * x + y.
    "selftest": Kernel("jaxflash.kernels.variants.selftest:SelfTestConfig",
                       "jaxflash.kernels.variants.selftest:selftest_launch",
                       (("main", "jaxflash.kernels.selftest:ScaleAdd"),),
                       ("sm_90a", "sm_100a")),
    # FlashAttention forward for Hopper.
    "sm90_fwd": Kernel("jaxflash.kernels.variants.fwd:FwdConfig",
                       "jaxflash.kernels.variants.fwd_launch:fwd_launch",
                       (("main", "jaxflash.kernels.sm90.fwd:FlashFwdSm90"),),
                       ("sm_90a",)),
    # FP8 (e4m3) forward for Hopper: the forward's mainloop with FP8 wgmma, V transposed in
    # shared memory by the producer warpgroup, 16-bit output.
    "sm90_fwd_fp8": Kernel("jaxflash.kernels.variants.fwd_fp8:Fp8FwdConfig",
                           "jaxflash.kernels.variants.fwd_fp8_launch:fwd_fp8_launch",
                           (("main", "jaxflash.kernels.sm90.fwd_fp8:FlashFwdSm90Fp8"),),
                           ("sm_90a",)),
    # FP4 Direct-P forward for Blackwell (non-causal inference): block-scaled tcgen05 MMAs
    # (NVFP4 QK^T, MXFP4 PV with P from tensor memory). Compiled and instruction-checked only.
    "sm100_fwd_fp4": Kernel("jaxflash.kernels.variants.sm100_fwd_fp4:Sm100FwdFp4Config",
                            "jaxflash.kernels.variants.fwd_fp4_launch:sm100_fwd_fp4_launch",
                            (("main", "jaxflash.kernels.sm100.fwd_fp4:FlashFwdFp4Sm100"),),
                            ("sm_100a",)),
    # FlashAttention backward for Hopper: dQ, dK, dV; head dims 192 / 256 split the head dim
    # over the consumer warpgroups (`BwdConfig.split`).
    "sm90_bwd": Kernel("jaxflash.kernels.variants.bwd:BwdConfig",
                       "jaxflash.kernels.variants.bwd_launch:bwd_launch",
                       (("main", "jaxflash.kernels.sm90.bwd:FlashBwdSm90"),
                        ("wide", "jaxflash.kernels.sm90.bwd_wide:FlashBwdSm90Wide")),
                       ("sm_90a",)),
    # FP8 backward for Hopper: E4M3 Q / K / V / P / dS, E5M2 dO; Q^T, K^T and dO^T come from
    # XLA (FP8 wgmma reads K-major operands only). hd 256 splits the head dim ("wide").
    "sm90_bwd_fp8": Kernel("jaxflash.kernels.variants.bwd_fp8:Fp8BwdConfig",
                           "jaxflash.kernels.variants.bwd_fp8_launch:bwd_fp8_launch",
                           (("main", "jaxflash.kernels.sm90.bwd_fp8:FlashBwdSm90Fp8"),
                            ("wide", "jaxflash.kernels.sm90.bwd_fp8_wide:FlashBwdSm90Fp8Wide")),
                           ("sm_90a",)),
    # FlashAttention forward for Blackwell: tcgen05 MMAs with S, P and O in tensor memory.
    # Compiled and instruction-checked only; dispatch gates it until a Blackwell run.
    "sm100_fwd": Kernel("jaxflash.kernels.variants.sm100_fwd:Sm100FwdConfig",
                        "jaxflash.kernels.variants.fwd_launch:sm100_fwd_launch",
                        (("main", "jaxflash.kernels.sm100.fwd:FlashFwdSm100"),
                         # `two_cta` variants: CTA pairs issuing cta_group::2 MMAs
                         ("pair", "jaxflash.kernels.sm100.fwd_2cta:FlashFwdSm100Pair")),
                        ("sm_100a",)),
    # FlashAttention backward for Blackwell: S^T, dP^T, dV, dK and dQ in tensor memory, dQ
    # added by TMA reduce-adds. Compiled and instruction-checked only; gated like the forward.
    "sm100_bwd": Kernel("jaxflash.kernels.variants.sm100_bwd:Sm100BwdConfig",
                        "jaxflash.kernels.variants.sm100_bwd_launch:sm100_bwd_launch",
                        (("main", "jaxflash.kernels.sm100.bwd:FlashBwdSm100"),),
                        ("sm_100a",)),
    # FP8 (e4m3) forward for Blackwell: the sm100 forward with kind::f8f6f4 MMAs, V read
    # MN-major (no transpose), e4m3 P in tensor memory. Compiled and instruction-checked only.
    "sm100_fwd_fp8": Kernel("jaxflash.kernels.variants.sm100_fwd_fp8:Sm100Fp8FwdConfig",
                            "jaxflash.kernels.variants.fwd_fp8_launch:sm100_fwd_fp8_launch",
                            (("main", "jaxflash.kernels.sm100.fwd_fp8:FlashFwdSm100Fp8"),),
                            ("sm_100a",)),
}
