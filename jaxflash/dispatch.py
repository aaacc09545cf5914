"""The one place that decides which backend runs a call.

Order of preference per platform (first that can serve wins when ``implementation=None``):

- cuda: cute (our CuTe DSL kernels), cudnn (jax.nn's cuDNN attention, wrapped to our
  semantics: GPUs and calls our kernels do not serve), pallas, xla
- rocm / tpu: pallas, xla
- cpu (and anything else): xla. Pallas runs on CPU only in interpret mode, which is far slower
  than XLA, so it is used there only when asked for by name (that is how CI tests it).

An explicitly named backend that cannot serve raises NotImplementedError with its reason. With
``None``, refused backends are skipped. The decision is one frozen `Plan` per call, carried to
the forward and the backward; `explain` prints it, and the ``jaxflash`` logger records each
fallback at INFO level.
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
from jaxflash.backends.cudnn import CudnnBackend
from jaxflash.backends.cute import CuteBackend
from jaxflash.backends.pallas import PallasBackend
from jaxflash.backends.xla import XlaBackend

logger = logging.getLogger("jaxflash")

IMPLEMENTATIONS = ("cute", "cudnn", "pallas", "xla")

_BACKENDS: dict[str, Backend] = {
    "cute": CuteBackend(),
    "cudnn": CudnnBackend(),
    "pallas": PallasBackend(),
    "xla": XlaBackend(),
}

_PREFERENCE = {
    "cuda": ("cute", "cudnn", "pallas", "xla"),
    "gpu": ("cute", "cudnn", "pallas", "xla"),
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
class Plan:
    """One call's decision, made once and carried to its forward and backward: which backend
    runs, that backend's own plan (``detail``: for ``cute`` the kernel launches), why every
    other backend was refused, and notes (e.g. which backward runs). Frozen and hashable: it is
    a static argument of the `jax.custom_vjp` and of the sharding rule."""

    problem: Problem
    backend: str | None
    refused: tuple[tuple[str, str], ...]
    requested: str | None
    detail: object = None
    notes: tuple[str, ...] = ()

    @property
    def platform(self) -> str:
        return self.problem.platform

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


def reference_only(problem: Problem):
    """Why only the reference (`implementation="xla"`) can serve `problem`, or None: what
    every kernel backend refuses alike, said once."""
    if problem.symbolic:
        return (f"symbolic {', '.join(dict.fromkeys(problem.symbolic))} (jax.export shape "
                f"polymorphism): its kernels are picked and compiled per shape")
    if problem.dtype == "float64":
        return ("float64 inputs: the kernels compute in float32 at most (the XLA reference "
                "computes in float64)")
    w = problem.statics.window
    if w is not None and min(w) < 0:
        return (f"window {tuple(w)} with a negative bound (its keys all after or all before "
                f"the query): the kernels' tile bounds take windows that hold the diagonal")
    return None


def _try(name: str, problem: Problem):
    """(detail, None) if backend `name` serves `problem`, else (None, why)."""
    backend = _BACKENDS[name]
    why = None if backend.reference else reference_only(problem)
    if why:
        return None, why
    try:
        return backend.plan(problem), None
    except NotImplementedError as e:
        return None, str(e) or f"{name} cannot serve this call"


def plan(problem: Problem, implementation: str | None) -> Plan:
    """The plan of `problem`, made once per call (it depends on the environment too: the
    verified gate, precompiled artifacts, the DSL's presence). Never raises; see `select`."""
    p = _plan(problem, implementation)
    note = problem.statics.mods_note
    return dataclasses.replace(p, notes=(note,) + p.notes) if note else p


def _plan(problem: Problem, implementation: str | None) -> Plan:
    if implementation is not None:
        detail, why = _try(implementation, problem)
        if why is None:
            return Plan(problem, implementation, (), implementation, detail,
                        _BACKENDS[implementation].notes(detail))
        return Plan(problem, None, ((implementation, why),), implementation)
    order = _PREFERENCE.get(problem.platform, _DEFAULT_PREFERENCE)
    refused = []
    for name in order:
        detail, why = _try(name, problem)
        if why is None:
            # Backends never considered on this platform are listed too, so `explain` is whole.
            for other in IMPLEMENTATIONS:
                if other not in order:
                    refused.append((other, f"not used automatically on {problem.platform}"
                                           + (" (interpret mode only; ask for it by name)"
                                              if other == "pallas" else "")))
            return Plan(problem, name, tuple(refused), None, detail,
                        _BACKENDS[name].notes(detail))
        refused.append((name, why))
    return Plan(problem, None, tuple(refused), None)


def select(problem: Problem, implementation: str | None) -> tuple[Backend, Plan]:
    """The backend that runs `problem` and the call's plan; NotImplementedError (with the
    whole plan's explanation) if no backend can, or the named one cannot."""
    p = plan(problem, implementation)
    if p.backend is None:
        raise NotImplementedError(str(p))
    if implementation is None:
        skipped = [n for n, _ in p.refused if n in _PREFERENCE.get(problem.platform, ())]
        # a fallback: a preferred backend skipped, or a forward whose backward runs elsewhere
        if (skipped and skipped[0] != p.backend) or getattr(p.detail, "bwd_reason", None):
            logger.info("%s", p)
    return _BACKENDS[p.backend], p
