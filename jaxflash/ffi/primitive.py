"""`call`: one JAX primitive per kernel launch, lowered to the DSL runtime's XLA FFI custom call.

Why a primitive of our own (and not `jax.ffi.ffi_call` at trace time):
- compilation belongs to LOWERING: tracing (`jax.eval_shape`, `make_jaxpr`, `explain`) never
  compiles, and lowering knows the target platform, so the same program lowers for CUDA on a
  machine without a GPU (``.lower(lowering_platforms=("cuda",))`` or `jax.export` with
  ``platforms=["cuda"]``) and refuses any other platform with a clear message;
- its parameters are the variant (`Launch`) and the output shapes only: a new batch or sequence
  length is a new jaxpr for jit but the same `Launch.key`, hence no recompile of the kernel;
- a batching rule of our own folds `jax.vmap` axes into the kernel's batch (dim 0).
The lowering emits ``jax.ffi.ffi_call(TARGET)`` with ``module`` (object bytes) and ``key``
(their sha256) attributes, the contract of ``libcute_dsl_runtime.so``'s handler. Everything the
call needs at run time is then inside the HLO, which is why a `jax.export` artifact runs with
only that library loaded (call `register_runtime()` before running a deserialized export).
"""
from __future__ import annotations

import functools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.interpreters import batching, mlir

from jaxflash import _vma
from jaxflash.ffi import cache, runtime
from jaxflash.ffi.variant import Launch

try:  # jax >= 0.4.36 public home; kept flexible for 0.10 / 0.11
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive

logger = logging.getLogger("jaxflash.ffi")

# jax marks an unmapped operand with None (jax.interpreters.batching.not_mapped, no longer public).
_NOT_MAPPED = None

cute_call_p = Primitive("jaxflash_cute_call")
cute_call_p.multiple_results = True


def call(launch: Launch, *inputs, out_shapes: Sequence, scalars: Sequence = (),
         int_scalars: Sequence = ()):
    """Run `launch` on `inputs`; returns a tuple of outputs shaped like `out_shapes`.

    inputs: arrays matching ``launch.inputs``; out_shapes: `jax.ShapeDtypeStruct` s matching
    ``launch.outputs`` (concrete dims for the dynamic ones); scalars / int_scalars: one value per
    name in ``launch.scalars`` / ``launch.int_scalars`` (Python numbers or traced 0-d arrays:
    they travel as device buffers, so their values never enter the variant key).
    """
    if len(inputs) != len(launch.inputs):
        raise ValueError(f"{launch.kernel}: {len(inputs)} inputs given, the variant takes "
                         f"{len(launch.inputs)}")
    for i, (x, t) in enumerate(zip(inputs, launch.inputs)):
        t.check(x, f"{launch.kernel} input {i}")
    out_shapes = tuple(jax.ShapeDtypeStruct(tuple(_dim(d) for d in s.shape), jnp.dtype(s.dtype))
                       for s in out_shapes)
    if len(out_shapes) != len(launch.outputs):
        raise ValueError(f"{launch.kernel}: {len(out_shapes)} output shapes given, the variant "
                         f"has {len(launch.outputs)}")
    for i, (s, t) in enumerate(zip(out_shapes, launch.outputs)):
        t.check(s, f"{launch.kernel} output {i}")
    args = list(inputs)
    for names, vals, dt in ((launch.scalars, scalars, jnp.float32),
                            (launch.int_scalars, int_scalars, jnp.int32)):
        if len(vals) != len(names):
            raise ValueError(f"{launch.kernel}: {len(vals)} values for scalars {names}")
        if names:
            args.append(jnp.stack([jnp.asarray(v, dt).reshape(()) for v in vals]))
    out_avals = tuple((s.shape, s.dtype.name) for s in out_shapes)
    bind = functools.partial(cute_call_p.bind, launch=launch, out_avals=out_avals)
    return tuple(_vma.kernel_call(bind, *args))  # typed inside a caller's shard_map


def _dim(d):
    """Concrete dims as int; symbolic ones (jax.export shape polymorphism) as they are."""
    try:
        return int(d)
    except Exception:  # a symbolic dimension: it stays symbolic, and dynamic in the kernel
        return d


def _abstract_eval(*args, launch, out_avals):
    return [jax.core.ShapedArray(shape, jnp.dtype(dt)) for shape, dt in out_avals]


cute_call_p.def_abstract_eval(_abstract_eval)


def _impl(*args, launch, out_avals):
    # Eager use: run through jit (the primitive only has a lowering, like any XLA custom call).
    return jax.jit(functools.partial(cute_call_p.bind, launch=launch, out_avals=out_avals))(*args)


cute_call_p.def_impl(_impl)


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except Exception:  # no CUDA plugin / no GPU: lowering or export only, nothing to register
        return False


def _lower_cuda(ctx, *args, launch, out_avals):
    binary = cache.get_binary(launch)  # compile (or load) happens here, at lowering
    if _has_cuda_backend():
        runtime.register()  # XLA needs the handler before it compiles this module
    results = [jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in out_avals]
    fn = jax.ffi.ffi_call(runtime.TARGET, results)

    def body(*xs):
        return fn(*xs, module=binary.module, key=binary.digest)

    return mlir.lower_fun(body, multiple_results=True)(ctx, *args)


def _lower_other(ctx, *args, launch, out_avals):
    plats = getattr(ctx.module_context, "platforms", None)
    raise NotImplementedError(
        f"jaxflash CuTe kernel {launch.kernel} can only be lowered for CUDA (asked: {plats}). "
        "To lower or export for a GPU from a machine without one, use "
        "`jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))` or "
        "`jax.export.export(jax.jit(f), platforms=['cuda'])` inside "
        "`jaxflash.target_platform('cuda')`.")


mlir.register_lowering(cute_call_p, _lower_other)
mlir.register_lowering(cute_call_p, _lower_cuda, platform="cuda")


# -- vmap --------------------------------------------------------------------------------------
def _batch(args, dims, *, launch, out_avals):
    """Fold mapped axes into dim 0 (the kernel's batch) of every tensor; see `_can_fold`."""
    n_t = len(launch.inputs)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    if size == 0:  # a vmap over an empty axis: empty outputs, and no launch on an empty grid
        outs = [jnp.zeros((0,) + tuple(s), dt) for s, dt in out_avals]
        return outs, [0] * len(outs)
    if _can_fold(launch, args, dims, out_avals):
        folded = []
        for a, d, t in zip(args[:n_t], dims[:n_t], launch.inputs):
            if d is _NOT_MAPPED:
                if t.shape[0] is not None:  # a fixed dim 0 is shared by every batch entry
                    folded.append(a)
                    continue
                a = jnp.broadcast_to(a[None], (size,) + a.shape)
            else:
                a = jnp.moveaxis(a, d, 0)
            folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        new_avals = tuple(((size * s[0],) + tuple(s[1:]), dt) for s, dt in out_avals)
        outs = cute_call_p.bind(*folded, *args[n_t:], launch=launch, out_avals=new_avals)
        outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
        return outs, [0] * len(outs)
    # Scalars differ per batch entry, or a tensor cannot be folded: one launch per entry.
    logger.info("jaxflash: vmap of %s runs one launch per batch entry (%s)", launch.kernel,
                "mapped runtime scalars" if any(d is not _NOT_MAPPED
                                                for d in dims[n_t:]) else "unfoldable tensor")
    moved = [a if d is _NOT_MAPPED else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    mapped = [d is not _NOT_MAPPED for d in dims]

    def one(xs):
        it = iter(xs)
        full = [next(it) if m else a for a, m in zip(moved, mapped)]
        return cute_call_p.bind(*full, launch=launch, out_avals=out_avals)

    outs = jax.lax.map(one, [a for a, m in zip(moved, mapped) if m])
    return list(outs), [0] * len(outs)


def _can_fold(launch, args, dims, out_avals) -> bool:
    n_t = len(launch.inputs)
    if any(d is not _NOT_MAPPED for d in dims[n_t:]):
        return False
    for a, d, t in zip(args[:n_t], dims[:n_t], launch.inputs):
        if len(t.shape) == 0:
            return False
        if d is not _NOT_MAPPED and t.shape[0] is not None:
            return False
    return all(len(t.shape) and t.shape[0] is None for t in launch.outputs)


batching.primitive_batchers[cute_call_p] = _batch
