"""``implementation="cute"``: the CuTe DSL kernels (`jaxflash.kernels`) run as XLA FFI custom
calls through `jaxflash.ffi`.

`check` refuses, with the precise reason, when: the platform is not CUDA; no kernel is written
for the target architecture (``$CUTE_DSL_ARCH``, else the local GPU's, else sm_90a); the kernel's
module is not in this checkout; the kernel's ``can_implement`` rejects the call (dtype, head dims,
features); or the CuTe DSL is absent and no precompiled artifact of the variant is in
``$JAXFLASH_KERNEL_DIR`` (the message holds the ``python -m jaxflash.aot`` command that builds it).

Forward: `jaxflash.kernels.sm90.fwd.FlashFwdSm90`, described by `jaxflash.kernels.variants.fwd_launch`.
Backward: `jaxflash.kernels.sm90.bwd.FlashBwdSm90` (`jaxflash.kernels.variants.bwd_launch`) when its
config accepts the call (dtype, head dims 64/96/128; 192/256 by
`jaxflash.kernels.sm90.bwd_wide.FlashBwdSm90Wide`, causal/window/softcap/lengths, GQA/MQA;
at 64/96/128 also segment ids, and ALiBi at 64/96 (not with softcap; d(slopes) returned);
``deterministic=True`` orders the dQ adds) and a binary is available; otherwise our Pallas
backward kernels on the (out, lse) this forward produced (same math). `explain` says which one
and why (`notes`).
"""
from __future__ import annotations

import importlib.util
import math

from jaxflash.backends.base import Backend

FWD_KERNEL = "hopper_fwd"
BWD_KERNEL = "hopper_bwd"


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
    kernel_module = "jaxflash.kernels.sm90.fwd"
    for mod in (kernel_module, cfg_ref.partition(":")[0], launch_ref.partition(":")[0]):
        if not _module_present(mod):
            raise NotImplementedError(f"the CuTe forward kernel is not in this checkout "
                                      f"(module {mod} missing)")
    from jaxflash.kernels.policy import choose
    try:
        config = choose.forward_config(problem)  # runs the kernel's can_implement
    except ValueError as e:
        raise NotImplementedError(f"the CuTe forward kernel cannot serve this call: {e}") from e
    from jaxflash.kernels.policy.verified import require_verified
    require_verified(config, "forward")
    return load_ref(launch_ref)(config, arch)


def bwd_launch_for(problem, arch: str | None = None):
    """The `jaxflash.ffi.Launch` serving `problem`'s backward (NotImplementedError with the
    reason if the CuTe backward cannot, i.e. the Pallas backward runs instead)."""
    from jaxflash.ffi.variant import current_arch, load_ref
    arch = arch or current_arch()
    cfg_ref, launch_ref, archs = _entry(BWD_KERNEL)
    if arch not in archs:
        raise NotImplementedError(f"no CuTe backward kernel for {arch}")
    for mod in (cfg_ref.partition(":")[0], launch_ref.partition(":")[0]):
        if not _module_present(mod):
            raise NotImplementedError(f"the CuTe backward kernel is not in this checkout "
                                      f"(module {mod} missing)")
    from jaxflash.kernels.policy import choose
    try:
        config = choose.backward_config(problem)
    except ValueError as e:
        raise NotImplementedError(str(e)) from e
    from jaxflash.kernels.policy.verified import require_verified
    require_verified(config, "backward")
    launch = load_ref(launch_ref)(config, arch)  # names the kernel class (key / hd split)
    kernel_module = launch.kernel.partition(":")[0]
    if not _module_present(kernel_module):
        raise NotImplementedError(f"the CuTe backward kernel is not in this checkout "
                                  f"(module {kernel_module} missing)")
    from jaxflash import ffi
    if not ffi.dsl_available():
        data, tried = ffi.find_artifact(launch)
        if data is None:
            raise NotImplementedError(
                f"no precompiled artifact of {launch.name} and no CuTe DSL here (build it "
                f"with: {ffi.aot_command(launch)})")
    return launch


def backward_choice(problem) -> tuple[object, str]:
    """(launch or None, a sentence saying which backward runs and why)."""
    try:
        launch = bwd_launch_for(problem)
    except NotImplementedError as e:
        return None, f"backward: Pallas kernels on the CuTe forward's (out, lse) ({e})"
    cls = launch.kernel.rpartition(":")[2]  # FlashBwdSm90, or FlashBwdSm90Wide at hd 192/256
    return launch, f"backward: CuTe kernel {cls} ({launch.config.key})"


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
        from jaxflash.kernels.variants.fwd_launch import fwd_inputs, fwd_scalars
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

    def notes(self, problem):
        return (backward_choice(problem)[1],)

    def backward(self, q, k, v, arrays, statics, problem, out, lse, dout):
        launch, _ = backward_choice(problem)
        if launch is None:
            # The Pallas backward takes any forward's (out, lse).
            from jaxflash import pallas_fallback
            return pallas_fallback.backward(q, k, v, arrays, statics, out, lse, dout,
                                            interpret=problem.platform == "cpu")
        return cute_backward(launch, q, k, v, arrays, statics, out, lse, dout)


def bwd_prepare(lse, dout, out, q_seqlen, Tp: int):
    """(lse2, delta) [B, N, Tp] float32, the backward kernel's O(T) inputs (see `cute_backward`)."""
    import jax.numpy as jnp
    T = lse.shape[-1]
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    # Rows that saw no key have LSE -inf; rows past q_seqlen get no gradient: +inf makes
    # P = exp2(s - lse2) exactly 0 there (never NaN).
    valid = lse > -jnp.inf
    if q_seqlen is not None:
        rows = jnp.arange(T, dtype=jnp.int32)
        valid &= rows[None, None, :] < q_seqlen.astype(jnp.int32)[:, None, None]
    lse2 = jnp.where(valid, lse * jnp.float32(math.log2(math.e)), jnp.inf)
    pad = ((0, 0), (0, 0), (0, Tp - T))
    lse2 = jnp.pad(lse2.astype(jnp.float32), pad, constant_values=jnp.inf)
    return lse2, jnp.pad(delta, pad)


def bwd_finish(dq_acc, T: int, cfg, scale: float, dtype):
    """dQ [B, T, N, H] from the kernel's float32 accumulator: un-permuted (`dq_flat`), scaled
    and cast, in one XLA fusion."""
    import jax.numpy as jnp
    from jaxflash.kernels.variants.bwd_launch import dq_from_flat
    if cfg.dq_flat:  # fragment order -> [B, T, N, H]
        dq_acc = dq_from_flat(dq_acc, T, cfg)
    return (dq_acc * jnp.float32(scale)).astype(dtype)


def cute_backward(launch, q, k, v, arrays, statics, out, lse, dout):
    """(dq, dk, dv, None, dslopes or None) by `FlashBwdSm90`: O(T) preprocessing (delta, log2
    LSE with +inf on rows that must get no gradient, padded for the kernel's TMA boxes; segment
    block summaries), the dQ postprocessing (scale and cast) and the d(slopes) reduction in
    XLA, everything O(T x S) in the kernel."""
    import jax
    import jax.numpy as jnp

    from jaxflash import ffi
    from jaxflash.kernels.variants.bwd_launch import dq_acc_shape, num_q_blocks, padded_len
    from jaxflash.kernels.variants.fwd_launch import fwd_scalars
    B, T, N, H = q.shape
    cfg = launch.config
    Tp = padded_len(T, cfg)
    dout = dout.astype(q.dtype)
    lse2, delta = bwd_prepare(lse, dout, out, arrays.q_seqlen, Tp)
    inputs = [q, k, v, dout, lse2, delta]
    if cfg.has_q_seqlen:
        inputs.append(arrays.q_seqlen.astype(jnp.int32))
    if cfg.has_kv_seqlen:
        inputs.append(arrays.kv_seqlen.astype(jnp.int32))
    if cfg.has_alibi:
        inputs.append(jnp.asarray(arrays.alibi_slopes, jnp.float32).reshape(1, N))
    if cfg.has_segments:
        # Block summaries with rows = keys, columns = queries (the backward's loop).
        from jaxflash.kernels.common.segments import block_summaries
        qs = jnp.asarray(arrays.q_segment_ids, jnp.int32)
        ks = jnp.asarray(arrays.kv_segment_ids, jnp.int32)
        kv_blocks, q_blocks = block_summaries(ks, qs, cfg.tile_n, cfg.tile_m)
        inputs += [qs, ks, kv_blocks, q_blocks]
    fs, is_ = fwd_scalars(statics)
    out_shapes = [jax.ShapeDtypeStruct(dq_acc_shape(B, T, N, H, cfg), jnp.float32),
                  jax.ShapeDtypeStruct(k.shape, k.dtype),
                  jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if cfg.has_alibi:  # per-warp partial sums of dS_ij |i - j|
        from jaxflash.kernels.variants.bwd import ALIBI_PARTS
        from jaxflash.kernels.variants.bwd_launch import num_k_blocks
        out_shapes.append(jax.ShapeDtypeStruct(
            (B, N, num_k_blocks(k.shape[1], cfg), ALIBI_PARTS), jnp.float32))
    if cfg.deterministic:  # the kernel's ordering semaphores (scratch)
        out_shapes.append(jax.ShapeDtypeStruct((B, N, num_q_blocks(T, cfg)), jnp.int32))
    outs = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs, int_scalars=is_)
    dq_acc, dk, dv = outs[:3]
    dq = bwd_finish(dq_acc, T, cfg, statics.scale, q.dtype)
    dslopes = None
    if cfg.has_alibi:
        # The logit holds -slope * |i - j|: d(slope) = -sum dS_ij |i - j| over b, i, j.
        dslopes = -outs[3].sum(axis=(0, 2, 3))
    return dq, dk, dv, None, dslopes
