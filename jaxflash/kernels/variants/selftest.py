"""Variant of the bridge's self-test kernel (`jaxflash.kernels.selftest`) and its launch
description. Imports no DSL, so runtime-only machines can form its variant key."""
from __future__ import annotations

import dataclasses



@dataclasses.dataclass(frozen=True)
class SelfTestConfig:
    """dtype of x, y and out. That is all that changes the binary: M, N and alpha do not."""

    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"SelfTestConfig: dtype {self.dtype!r} not in float32/float16/bfloat16")

    @property
    def key(self) -> str:
        return f"scaleadd_{self.dtype}"


def can_implement(config: SelfTestConfig) -> tuple[bool, str]:
    return True, ""


def selftest_launch(config: SelfTestConfig, arch: str | None = None):
    """x, y [M, N] (both dims dynamic) -> out [M, N]; float scalar alpha."""
    from jaxflash.ffi.variant import Launch, TensorArg
    from jaxflash.kernels import KERNELS
    t = TensorArg(config.dtype, (None, None))
    return Launch(KERNELS["selftest"].kernel_class(), config, (t, t), (t,), scalars=("alpha",), arch=arch)


def scale_add(x, y, alpha, arch: str | None = None):
    """``alpha * x + y`` through the bridge (x, y: same shape [M, N] and dtype)."""
    import jax
    from jaxflash.ffi import call
    if x.shape != y.shape or x.dtype != y.dtype or x.ndim != 2:
        raise ValueError(f"scale_add: x {x.dtype}{list(x.shape)} and y {y.dtype}{list(y.shape)} "
                         "must be 2-D of one shape and dtype")
    launch = selftest_launch(SelfTestConfig(str(x.dtype)), arch)
    return call(launch, x, y, out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                scalars=(alpha,))[0]
