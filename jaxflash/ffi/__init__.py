"""The CuTe DSL -> XLA bridge: a kernel written with the CuTe DSL runs inside XLA as an FFI custom
call on XLA's own stream (works under `jax.jit`, in CUDA graphs / command buffers, survives
`jax.export`), with compile caches and a runtime-only mode. This package never imports the DSL
(`cutlass`) at import time: lowering and running work where only precompiled artifacts exist.

THE KERNEL INTERFACE (what a kernel must offer the bridge)
=========================================================

1. Two modules per kernel.
   - ``jaxflash/kernels/<name>.py`` imports ``cutlass`` and defines the kernel class, e.g.
     ``FlashFwdSm90``. The bridge refers to it by the string ``"jaxflash.kernels.<name>:Class"``
     and imports it only when it must compile.
   - Its config: a ``@dataclasses.dataclass(frozen=True)`` defined in a module that does NOT
     import ``cutlass`` (e.g. ``jaxflash/kernels/variants/fwd.py``), because machines without the DSL
     (the GPU box) must still form the variant key. Fields hold everything that changes the
     binary (dtype, head dims, mask features, tile config, ...) and are JSON values only
     (str, int, float, bool, None, tuples of those); ``Config(**fields)`` must rebuild it.
     Nothing that may change between calls without a recompile belongs in it (batch, lengths,
     scale/softcap values, window bounds): those are runtime values (below).

2. The class: ``Kernel(config)`` then a ``@cute.jit`` ``__call__`` with exactly this order::

       def __call__(self, *inputs, *outputs, [fscalars], [iscalars], stream)

   - ``inputs`` / ``outputs``: one ``cute.Tensor`` per tensor of the launch, in the order the
     launch (`Launch.inputs`, `Launch.outputs`) lists them; outputs are written by the kernel.
   - ``fscalars``: present iff ``Launch.scalars`` is non-empty: a float32 ``cute.Tensor`` of shape
     ``(len(Launch.scalars),)`` in global memory, element i = the i-th named scalar (e.g. scale,
     softcap). ``iscalars`` likewise, int32, for ``Launch.int_scalars`` (e.g. window bounds).
     READ THEM IN DEVICE CODE (``s = fscalars[0]`` inside the ``@cute.kernel``): XLA's FFI hands
     the compiled launcher only device buffers, so a host-side ``Float32`` parameter is not
     possible; in exchange a new scale never recompiles anything and may even be traced.
   - ``stream``: ``cuda.CUstream``, XLA's stream; launch every kernel on it.

3. Tensor descriptions (`TensorArg`): dtype (numpy name), shape with ``None`` for DYNAMIC dims
   (taken from the XLA buffer at run time; any value works without a recompile) and ints for
   dims fixed by the variant, optional ``mode`` (a permutation: the kernel sees
   ``cute.select(layout, mode)``, e.g. ``(1, 3, 2, 0)`` presents q ``[B, T, N, H]`` as
   ``(T, H, N, B)``; no data moves) and optional ``divisibility`` (per dim, a promise the caller
   keeps, e.g. alignment for TMA), and ``align`` (bytes the data pointer may be assumed aligned
   to; default and maximum 16, XLA's guarantee). Buffers are XLA's default row-major, compact;
   strides are derived from the (runtime) shape. Static dims also become divisibility facts (a
   fixed last dim D makes every stride a multiple of D).

4. Variant key (`Launch.key`): sha256 of the canonical JSON of (kernel ref, config class and
   fields, input/output TensorArgs, scalar names, arch, e.g. ``"sm_90a"``) plus a hash of the
   kernel's source files (its module and every ``jaxflash.kernels`` module it imports, found by
   reading the imports, plus the config module and the bridge's launcher). The on-disk cache adds
   the DSL version. A readable `Launch.name` prefixes the key in file names.

5. Optional: ``can_implement`` in the DSL-free config module, ``(config) -> (ok, reason)``; the
   backend adapter calls it to refuse with the reason before any compile.

Calling a kernel (what a backend adapter does)::

    from jaxflash import ffi
    launch = ffi.Launch(kernel="jaxflash.kernels.selftest:ScaleAdd", config=SelfTestConfig(),
                        inputs=(ffi.TensorArg("float32", (None, None)),) * 2,
                        outputs=(ffi.TensorArg("float32", (None, None)),), scalars=("alpha",))
    (out,) = ffi.call(launch, x, y, out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                      scalars=(alpha,))

`ffi.call` checks every array against the launch, binds one primitive whose lowering (for the
CUDA platform) fetches the binary: memory cache -> ``$JAXFLASH_KERNEL_DIR`` (precompiled, see
``python -m jaxflash.aot``) -> disk cache (``$JAXFLASH_CACHE_DIR``, default
``~/.cache/jaxflash``) -> compile with the DSL (once per variant per process, under a lock).
Under `jax.vmap`, mapped axes are folded into dim 0 of every tensor (the kernel's batch), which
must therefore be dynamic. The FFI target is the DSL runtime's ``CuteDSLRT_NvJaxCutlassCall_v2``
(library from ``$CUTE_DSL_RUNTIME_LIB`` or the installed DSL), registered once on first use.
"""
from __future__ import annotations

from jaxflash.ffi.cache import (  # noqa: E402
    Binary, MissingVariantError, aot_command, dsl_available, find_artifact, get_binary)
from jaxflash.ffi.primitive import call  # noqa: E402
from jaxflash.ffi.runtime import (  # noqa: E402
    TARGET, RuntimeLibraryError, find_runtime_library, is_registered)
from jaxflash.ffi.runtime import register as register_runtime  # noqa: E402
from jaxflash.ffi.variant import Launch, TensorArg, current_arch  # noqa: E402


# The custom call of Pallas' Triton kernels (the Pallas backend, precision="fp8"'s prologue).
TRITON_TARGET = "__gpu$xla.gpu.triton"


def export_safety_checks():
    """Pass as ``disabled_checks=`` to `jax.export.export`: the custom calls jaxflash emits are
    not on jax's list of targets with a stability guarantee: ours (the artifact is only valid
    with this runtime) and Pallas' Triton kernels (the Pallas backend, the FP8 prologue; valid
    with the jaxlib that exported them)."""
    import jax.export
    return [jax.export.DisabledSafetyCheck.custom_call(TARGET),
            jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]


__all__ = ["Binary", "Launch", "MissingVariantError", "RuntimeLibraryError", "TARGET",
           "TensorArg", "aot_command", "call", "current_arch", "dsl_available",
           "export_safety_checks", "find_artifact", "find_runtime_library", "get_binary",
           "is_registered", "register_runtime"]
