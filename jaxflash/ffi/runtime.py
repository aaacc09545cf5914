"""The run-time half of the bridge: the CuTe DSL runtime library and its XLA FFI targets.

We run kernels through the FFI handlers inside the DSL's ``libcute_dsl_runtime.so`` (standalone:
no Python DSL needed) rather than a handler of our own, because that library is the one that
understands the objects ``dump_to_object`` writes (its loader, version checks and per-context
module cache keyed by the ``key`` attribute) and its v2 handler is stateful (prepare /
instantiate / execute) and declared CUDA-graph compatible, so XLA can capture it in command
buffers. Registration needs only ctypes and jax, so it works where the DSL is absent.

Library search: ``$CUTE_DSL_RUNTIME_LIB``, then the installed ``nvidia_cutlass_dsl`` wheel (found
without importing the DSL). Targets are registered once per process, on first lowering for CUDA
when a CUDA backend is present (registration is only needed to compile/run, not to lower).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from typing import Optional

ENV_RUNTIME_LIB = "CUTE_DSL_RUNTIME_LIB"

# The CUDA-graph-capable stateful target of the DSL runtime (jax >= 0.9.1: we need >= 0.10).
TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
_HANDLER = {
    "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2",
    "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
    "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v2",
}
_STATE_TYPE = ("CuteDSLRT_NvJaxCutlassCallTypes_v2", {
    "type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
    "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2",
})

_lock = threading.Lock()
_registered: Optional[str] = None  # path of the library whose targets are registered


class RuntimeLibraryError(RuntimeError):
    """The CuTe DSL runtime library cannot be found or does not have the FFI handlers."""


def find_runtime_library() -> Optional[str]:
    p = os.environ.get(ENV_RUNTIME_LIB)
    if p:
        return p
    return _installed_runtime_library()


def _installed_runtime_library() -> Optional[str]:
    """The installed nvidia_cutlass_dsl wheel's runtime library (found without importing it)."""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = []
    for root in spec.submodule_search_locations:
        libs += glob.glob(os.path.join(root, "cu1*", "lib", "libcute_dsl_runtime.so"))
    return sorted(libs)[-1] if libs else None  # cu13 sorts after cu12


def register(platform: str = "CUDA") -> str:
    """Load the runtime library and register its FFI type and target with XLA (once).
    Returns the library path; RuntimeLibraryError if it is missing or lacks the handlers."""
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        path = find_runtime_library()
        if not path:
            raise RuntimeLibraryError(
                "the CuTe DSL runtime library (libcute_dsl_runtime.so) was not found: set "
                f"${ENV_RUNTIME_LIB} to its path (on the GPU machine: `export "
                f"{ENV_RUNTIME_LIB}=$(bash .device/unpack.sh)`), or install nvidia-cutlass-dsl")
        if not os.path.isfile(path):
            raise RuntimeLibraryError(
                f"${ENV_RUNTIME_LIB}={path}: no such file. {_fix_hint(path)}")
        try:
            lib = ctypes.CDLL(path)
            syms = {stage: getattr(lib, name) for stage, name in _HANDLER.items()}
            type_syms = {k: getattr(lib, name) for k, name in _STATE_TYPE[1].items()}
        except (OSError, AttributeError) as e:
            raise RuntimeLibraryError(
                f"cannot use {path} as the CuTe DSL runtime ({e}): it must be the "
                f"libcute_dsl_runtime.so shipped with nvidia-cutlass-dsl (it has the "
                f"{TARGET} handlers). {_fix_hint(path)}") from e
        import jax
        for f in list(syms.values()) + list(type_syms.values()):
            f.restype = ctypes.c_void_p
        # The state type must be known before the stateful handler that uses it.
        jax.ffi.register_ffi_type(
            _STATE_TYPE[0], {k: jax.ffi.pycapsule(f()) for k, f in type_syms.items()},
            platform=platform)
        jax.ffi.register_ffi_target(
            TARGET, {stage: jax.ffi.pycapsule(f) for stage, f in syms.items()},
            platform=platform)
        _registered = path
        return path


def _fix_hint(path: str) -> str:
    """How to point the bridge at a runtime library that works instead of `path`."""
    installed = _installed_runtime_library()
    if installed and os.path.abspath(installed) != os.path.abspath(path):
        return f"Unset ${ENV_RUNTIME_LIB} to use the installed {installed}, or point it there."
    return (f"Point ${ENV_RUNTIME_LIB} at libcute_dsl_runtime.so (on the GPU machine: `export "
            f"{ENV_RUNTIME_LIB}=$(bash .device/unpack.sh)`), or install nvidia-cutlass-dsl.")


def is_registered() -> bool:
    return _registered is not None
