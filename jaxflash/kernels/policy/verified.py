"""Which kernel variants have been checked on a GPU, and the switch that admits the others.

CI compiles every variant for sm_90a without a GPU, but compiling proves nothing about the
numbers. A variant whose features were written and compiled here but have not yet been compared
with the float64 reference on a real GPU is *unverified*: dispatch does not choose it (the call
runs on the Pallas path, and ``explain`` says why), unless the user opts in with
``JAXFLASH_CUTE_UNVERIFIED=1`` (for whoever runs the GPU checks, or wants to try them).

What is pending lives here, in `RULES`, and not in the config classes: `variants/fwd.py` and
`variants/bwd.py` are hashed into every compiled artifact's key (`jaxflash.ffi.variant`), so
clearing a feature after its GPU run would otherwise invalidate every precompiled binary (the
same reason `choose.py` is apart). This module only names features; nothing a kernel imports
imports it. Which checks cleared which feature is in docs/design.md.
"""
from __future__ import annotations

from jaxflash._types import env_flag

ENV = "JAXFLASH_CUTE_UNVERIFIED"
BLACKWELL_PENDING = ("the sm_100a kernels (compiled and instruction-checked only, gated until a "
                     "Blackwell run)")


def allowed() -> bool:
    return env_flag(ENV)


# Per config class: (feature name, predicate) pairs; a config using a named feature is pending.
# A feature is cleared (its rule removed) once its float64 check cases (`devtools.fwd_cases`,
# `devtools.bwd_cases`) pass on the H200 with memcheck and racecheck clean; each cleared
# feature's checks are listed in docs/design.md.
# Every bf16 / fp16 feature the configs can express has been cleared; a new one is named here
# until then, e.g. "FwdConfig": (("a new mask", lambda c: c.new_mask),). Cleared without
# sanitizer runs (their logs are in benchmarks/results): the FP8 forward (with V^T from the
# XLA side, hd 64's 192-row tiles, the persistent tile loop and the conditional O rescale) by
# tests/kernels/test_fp8_gpu.py on the H200; the score / mask mods by
# tests/kernels/test_mods_gpu.py and tests/mods/test_mods_gpu.py; the FP8 backward (hd 64 /
# 128 and hd 256's head-dim split) by tests/kernels/test_fp8_bwd_gpu.py (compute-sanitizer
# segfaulted on the test process, its log holds no report: no sanitizer verdict exists).
RULES: dict[str, tuple] = {
    # Every sm_100a variant: no Blackwell GPU has run them yet. Cleared by the first-run kit's
    # float64 checks and sanitizers on a B200.
    "Sm100FwdConfig": ((BLACKWELL_PENDING, lambda c: True),),
    "Sm100FwdFp4Config": ((BLACKWELL_PENDING, lambda c: True),),
    "Sm100BwdConfig": ((BLACKWELL_PENDING, lambda c: True),),
    "Sm100Fp8FwdConfig": ((BLACKWELL_PENDING, lambda c: True),),
}


def pending(config) -> tuple[str, ...]:
    """The features of `config` not yet cleared for dispatch (empty when all were checked;
    a config class without rules has none pending)."""
    return tuple(name for name, uses in RULES.get(type(config).__name__, ()) if uses(config))


def require_verified(config, what: str) -> None:
    """NotImplementedError naming the unverified features of `config` unless the switch is on."""
    pending_ = pending(config)
    if pending_ and not allowed():
        raise NotImplementedError(
            f"the CuTe {what} variant {config.key} uses {', '.join(pending_)}, compiled but not "
            f"yet checked on a GPU; set {ENV}=1 to run it anyway")
