"""Compiles one `Launch` with the CuTe DSL into the object bytes the DSL runtime's XLA FFI handler
loads. The only module of the bridge that imports ``cutlass``; imported only to compile.

Design (why it looks like this):
- The FFI handler (``CuteDSLRT_NvJaxCutlassCall_v2`` in ``libcute_dsl_runtime.so``) loads the
  ``module`` attribute's object, looks up the host function exported under the prefix
  ``cutlass_call`` and calls it with XLA's stream followed by one descriptor per buffer (operands,
  then results). So the function we compile is our own small launcher, `_launcher`, with exactly
  that signature; it turns descriptors into ``cute.Tensor`` s and calls the kernel in the order the
  interface fixes (inputs, outputs, float scalars, int scalars, stream).
- Descriptor -> tensor uses the DSL's own ``cutlass.jax`` argument types (``JaxArray`` and its
  traced placeholder). They are the other half of the handler's ABI, maintained with it, so we
  call them instead of re-deriving the descriptor layout (which could drift from the runtime).
  Dims we mark dynamic are given to it as ``None``: it then loads them from the descriptor at run
  time and assumes nothing about them, which is what lets batch/sequence length change freely.
- We call ``cute.compile`` directly (not ``cutlass.jax.cutlass_call``) because that path keys
  its cache by concrete shapes (a recompile per batch/length), keeps no disk cache and has no
  runtime-only mode; our caching lives in `jaxflash.ffi.cache`.
"""
from __future__ import annotations

import contextlib
import os
import threading

# The DSL reads its target (``CUTE_DSL_ARCH``, else the local GPU, else sm_100a) once, into its
# settings singleton; when that differs from ``--gpu-arch`` it may try to build a host JIT engine
# for a GPU that is not there and fail to export. We keep the two equal per compile (below). The
# variable is set for the import only: left set, it would name the target of every later
# variant (`jaxflash.ffi.variant.current_arch` reads it), whatever the GPU.
_ARCH_BEFORE = os.environ.get("CUTE_DSL_ARCH")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cutlass_dsl.cutlass import CuTeDSL  # noqa: E402
from cutlass.jax.types import (  # noqa: E402
    DEFAULT_CUTLASS_DEVICE_MEMSPACE, JaxArray, JaxTracedArray, jax_to_cutlass_dtype)

if _ARCH_BEFORE is None:
    os.environ.pop("CUTE_DSL_ARCH", None)

from jaxflash.ffi.variant import Launch, TensorArg, load_ref  # noqa: E402

# Prefix the runtime's handler looks up (``cutlass_call`` in libcute_dsl_runtime.so).
EXPORT_PREFIX = "cutlass_call"
# DSL tracing mutates process-global state: one compile at a time in a process.
_DSL_LOCK = threading.Lock()


def dsl_version() -> str:
    from importlib.metadata import version
    return version("nvidia-cutlass-dsl")


@cute.jit
def _launcher(stream: cuda.CUstream, *buffers, kernel: cutlass.Constexpr,
              n_in: cutlass.Constexpr, n_scalar_tensors: cutlass.Constexpr):
    # FFI order: inputs, scalar tensors (operands), then outputs (results).
    tensors = [b.get_tensor() for b in buffers]
    ins = tensors[:n_in]
    scal = tensors[n_in:n_in + n_scalar_tensors]
    outs = tensors[n_in + n_scalar_tensors:]
    kernel(*ins, *outs, *scal, stream)


def _placeholder(t: TensorArg):
    import jax.numpy as jnp
    order = tuple(reversed(range(len(t.shape))))  # row-major: what XLA gives by default
    return JaxTracedArray(JaxArray(jax_to_cutlass_dtype(jnp.dtype(t.dtype)), t.shape,
                                   DEFAULT_CUTLASS_DEVICE_MEMSPACE, t.align, order, t.mode,
                                   False, t.divisibility))


def compile_launch(launch: Launch) -> bytes:
    """Compile `launch` for ``launch.arch``; returns the object bytes for the FFI handler."""
    kernel_cls = load_ref(launch.kernel)
    args = [_placeholder(t) for t in launch.inputs]
    if launch.scalars:
        args.append(_placeholder(TensorArg("float32", (len(launch.scalars),))))
    if launch.int_scalars:
        args.append(_placeholder(TensorArg("int32", (len(launch.int_scalars),))))
    args += [_placeholder(t) for t in launch.outputs]
    n_scal = bool(launch.scalars) + bool(launch.int_scalars)
    with target_arch(launch.arch):
        kernel = kernel_cls(launch.config)
        compiled = cute.compile(_launcher, cuda.CUstream(0), *args, kernel=kernel,
                                n_in=len(launch.inputs), n_scalar_tensors=n_scal,
                                options=f"--gpu-arch {launch.arch}")
        return bytes(compiled.dump_to_object(EXPORT_PREFIX))


@contextlib.contextmanager
def target_arch(arch: str):
    """Make the DSL target `arch` inside the block (one DSL user at a time in a process).

    The DSL reads its target once, at import, into a settings singleton; a process that imported
    it before CUTE_DSL_ARCH was set (or that compiles for several architectures) must set both
    the variable and that singleton, which is what `cutlass.jax` itself reaches for.
    """
    with _DSL_LOCK:
        prev = os.environ.get("CUTE_DSL_ARCH")
        envar = CuTeDSL._get_dsl().envar
        prev_arch = envar.arch
        os.environ["CUTE_DSL_ARCH"] = arch
        envar.arch = arch
        try:
            yield
        finally:
            envar.arch = prev_arch
            if prev is None:
                os.environ.pop("CUTE_DSL_ARCH", None)
            else:
                os.environ["CUTE_DSL_ARCH"] = prev
