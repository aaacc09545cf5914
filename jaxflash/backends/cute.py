"""``implementation="cute"``: the CuTe DSL kernels (`jaxflash.kernels`) run as XLA FFI custom
calls through `jaxflash.ffi`.

`check` refuses, with the precise reason, when: the platform is not CUDA; no kernel is written
for the target architecture (``$CUTE_DSL_ARCH``, else the local GPU's, else sm_90a); the kernel's
module is not in this checkout; the kernel's ``can_implement`` rejects the call (dtype, head dims,
features); or the CuTe DSL is absent and no precompiled artifact of the variant is in
``$JAXFLASH_KERNEL_DIR`` (the message holds the ``python -m jaxflash.aot`` command that builds it).

Forward: `jaxflash.kernels.hopper_fwd.FlashFwdSm90`, described by `jaxflash.kernels.fwd_launch`.
Backward: there is no CuTe backward kernel yet; the backward runs our Pallas backward kernels on
the (out, lse) this forward produced (same math, documented here and in `explain`'s text).
"""
from __future__ import annotations

import importlib.util

from jaxflash.backends.base import Backend

FWD_KERNEL = "hopper_fwd"
_BACKWARD_NOTE = "backward: Pallas kernels on the CuTe forward's (out, lse)"


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _entry(kernel: str):
    from jaxflash.kernels import KERNELS
    return KERNELS[kernel]


def fwd_launch_for(problem, arch: str | None = None):
    """The `jaxflash.ffi.Launch` serving `problem`'s forward (NotImplementedError if none)."""
    from jaxflash.ffi.variant import current_arch, load_ref
    arch = arch or current_arch()
    cfg_ref, launch_ref, archs = _entry(FWD_KERNEL)
    if arch not in archs:
        raise NotImplementedError(
            f"no CuTe forward kernel for {arch} (kernels exist for {', '.join(archs)}; the "
            "target comes from $CUTE_DSL_ARCH, else the local GPU)")
    kernel_module = "jaxflash.kernels.hopper_fwd"
    for mod in (kernel_module, cfg_ref.partition(":")[0], launch_ref.partition(":")[0]):
        if not _module_present(mod):
            raise NotImplementedError(f"the CuTe forward kernel is not in this checkout "
                                      f"(module {mod} missing)")
    cfg_mod = importlib.import_module(cfg_ref.partition(":")[0])
    try:
        config = cfg_mod.config_for(problem)  # runs the kernel's can_implement
    except ValueError as e:
        raise NotImplementedError(f"the CuTe forward kernel cannot serve this call: {e}") from e
    return load_ref(launch_ref)(config, arch)


class CuteBackend(Backend):
    name = "cute"

    def check(self, problem):
        if problem.platform not in ("cuda", "gpu"):
            raise NotImplementedError(f"CuTe kernels run on CUDA only (platform {problem.platform})")
        launch = fwd_launch_for(problem)
        from jaxflash import ffi
        if ffi.dsl_available():
            return  # compiles at lowering if no artifact is cached
        data, tried = ffi.find_artifact(launch)
        if data is None:
            raise NotImplementedError(
                f"the CuTe DSL is not installed here and no precompiled artifact of variant "
                f"{launch.name} was found ({'; '.join(tried)}); build it with: "
                f"{ffi.aot_command(launch)}")

    def forward(self, q, k, v, arrays, statics, problem):
        import jax
        import jax.numpy as jnp

        from jaxflash import ffi
        from jaxflash.kernels.fwd_launch import fwd_inputs, fwd_scalars
        launch = fwd_launch_for(problem)
        B, T, N, _ = q.shape
        # The launch's optional inputs in its order; segment block summaries (for the kernel's
        # block skipping) are computed here in XLA, sized by the variant's tiles.
        inputs = fwd_inputs(launch.config, q, k, v, q_seqlen=arrays.q_seqlen,
                            kv_seqlen=arrays.kv_seqlen, alibi_slopes=arrays.alibi_slopes,
                            q_segment_ids=arrays.q_segment_ids,
                            kv_segment_ids=arrays.kv_segment_ids)
        fs, is_ = fwd_scalars(statics)
        out_shapes = [jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), q.dtype),
                      jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
        out, lse = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs, int_scalars=is_)
        return out, lse

    def backward(self, q, k, v, arrays, statics, problem, out, lse, dout):
        # No CuTe backward kernel yet: the Pallas backward, which takes any forward's (out, lse)
        # and every array of `arrays` (ALiBi slopes and segment ids included).
        from jaxflash import pallas_fallback
        return pallas_fallback.backward(q, k, v, arrays, statics, out, lse, dout,
                                        interpret=problem.platform == "cpu")
