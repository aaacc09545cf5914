"""Variant of the bridge's self-test kernel (`jaxflash.kernels._selftest`); imports no DSL, so
runtime-only machines can form its variant key."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SelfTestConfig:
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"SelfTestConfig: dtype {self.dtype!r} not in float32/float16/bfloat16")


def can_implement(config: SelfTestConfig) -> tuple[bool, str]:
    return True, ""
