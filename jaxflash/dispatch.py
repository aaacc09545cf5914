"""The one place that decides which backend runs a call.

Order of preference per platform (first that can serve wins when ``implementation=None``):

- cuda: cute (our CuTe DSL kernels), pallas, xla
- rocm / tpu: pallas, xla
- cpu (and anything else): xla. Pallas runs on CPU only in interpret mode, which is far slower
  than XLA, so it is used there only when asked for by name (that is how CI tests it).

An explicitly named backend that cannot serve raises NotImplementedError with its reason. With
``None``, refused backends are skipped; `explain` reports the choice and every refusal, and the
``jaxflash`` logger records each fallback at INFO level.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading

import jax

from jaxflash._types import Problem
from jaxflash.backends.base import Backend
from jaxflash.backends.cute import CuteBackend
from jaxflash.backends.pallas import PallasBackend
from jaxflash.backends.xla import XlaBackend

logger = logging.getLogger("jaxflash")

IMPLEMENTATIONS = ("cute", "pallas", "xla")

_BACKENDS: dict[str, Backend] = {
    "cute": CuteBackend(),
    "pallas": PallasBackend(),
    "xla": XlaBackend(),
}

_PREFERENCE = {
    "cuda": ("cute", "pallas", "xla"),
    "gpu": ("cute", "pallas", "xla"),
    "rocm": ("pallas", "xla"),
    "tpu": ("pallas", "xla"),
}
_DEFAULT_PREFERENCE = ("xla",)

_local = threading.local()


@contextlib.contextmanager
def target_platform(platform: str):
    """Trace as if for `platform` ("cuda", "tpu", "cpu", ...), e.g. to lower or export for a GPU
    from a machine without one. ``JAXFLASH_PLATFORM`` in the environment does the same globally."""
    prev = getattr(_local, "platform", None)
    _local.platform = platform
    try:
        yield
    finally:
        _local.platform = prev


def current_platform() -> str:
    p = getattr(_local, "platform", None) or os.environ.get("JAXFLASH_PLATFORM")
    if p:
        return p.lower()
    return jax.default_backend()


def get_backend(name: str) -> Backend:
    return _BACKENDS[name]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which backend serves a problem, and why each other one was refused."""

    backend: str | None
    refused: tuple[tuple[str, str], ...]
    platform: str
    requested: str | None
    notes: tuple[str, ...] = ()  # from the chosen backend, e.g. which backward runs

    def __str__(self) -> str:
        head = (f"jaxflash on {self.platform}: "
                + (f"'{self.backend}' runs" if self.backend else "no backend can run this call")
                + (" (asked for by name)" if self.requested else " (best available)"))
        lines = [head]
        for note in self.notes:
            lines.append(f"  {note}")
        for name, why in self.refused:
            lines.append(f"  - '{name}' refused: {why}")
        return "\n".join(lines)


def decide(problem: Problem, implementation: str | None) -> Decision:
    """Choose the backend for `problem`. Never raises; see `select`."""
    if implementation is not None:
        why = _BACKENDS[implementation].reason(problem)
        if why is None:
            return Decision(implementation, (), problem.platform, implementation,
                            _BACKENDS[implementation].notes(problem))
        return Decision(None, ((implementation, why),), problem.platform, implementation)
    order = _PREFERENCE.get(problem.platform, _DEFAULT_PREFERENCE)
    refused = []
    for name in order:
        why = _BACKENDS[name].reason(problem)
        if why is None:
            # Backends never considered on this platform are listed too, so `explain` is whole.
            for other in IMPLEMENTATIONS:
                if other not in order:
                    refused.append((other, f"not used automatically on {problem.platform}"
                                           + (" (interpret mode only; ask for it by name)"
                                              if other == "pallas" else "")))
            return Decision(name, tuple(refused), problem.platform, None,
                            _BACKENDS[name].notes(problem))
        refused.append((name, why))
    return Decision(None, tuple(refused), problem.platform, None)


def select(problem: Problem, implementation: str | None) -> Backend:
    """The backend that runs `problem`; NotImplementedError if the named one cannot."""
    d = decide(problem, implementation)
    if d.backend is None:
        raise NotImplementedError(str(d))
    if implementation is None and d.refused:
        skipped = [n for n, _ in d.refused if n in _PREFERENCE.get(problem.platform, ())]
        if skipped and skipped[0] != d.backend:
            logger.info("%s", d)
    return _BACKENDS[d.backend]
