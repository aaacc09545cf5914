"""Which kernel variants have been checked on a GPU, and the switch that admits the others.

CI compiles every variant for sm_90a without a GPU, but compiling proves nothing about the
numbers. A variant whose features were written and compiled here but have not yet been compared
with the float64 reference on a real GPU is *unverified*: dispatch does not choose it (the call
runs on the Pallas path, and ``explain`` says why), unless the user opts in with
``JAXFLASH_CUTE_UNVERIFIED=1`` (for whoever runs the GPU checks, or wants to try them).

Each kernel config lists its own unverified features (``config.unverified()``: a tuple of
names, empty when everything it uses was checked); this module only applies the switch, so
every kernel is gated the same way and in one place (`jaxflash.backends.cute`).
"""
from __future__ import annotations

import os

ENV = "JAXFLASH_CUTE_UNVERIFIED"


def allowed() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def require_verified(config, what: str) -> None:
    """NotImplementedError naming the unverified features of `config` unless the switch is on."""
    pending = tuple(getattr(config, "unverified", lambda: ())())
    if pending and not allowed():
        raise NotImplementedError(
            f"the CuTe {what} variant {config.key} uses {', '.join(pending)}, compiled but not yet "
            f"checked on a GPU; set {ENV}=1 to run it anyway")
