"""The SPMD facts a value's type carries, read in one place: the Explicit mesh axes it is
sharded over (`explicit_axes`, `typed_sharding`), the manual axes it varies over inside a
caller's `shard_map` (`varying_axes`, `vary`, `kernel_call`), and a vmap tracer's batched value
(`BatchTracer`).

Kernel calls inside a caller's `shard_map` with JAX's varying-axes checks on (its default):
there every value's type names the manual mesh axes it varies over, and each primitive has a
rule for those types. A kernel call (a Pallas call, our FFI custom call) has none: a Pallas call
refuses to trace, and an FFI call's results would be typed as the same on every device (they
are not). `kernel_call` makes a kernel's operands vary alike, traces the call with the checks
off, and types its results as varying over those axes: what they are, per-device values. Its
cotangents then take their primals' types (`jaxflash.autodiff`), and JAX's own transpose of
the cast sums the gradient of an operand the devices share (a replicated k) over them.
Outside shard_map, or with the checks off, there are no such axes and nothing changes.
"""
from __future__ import annotations

import contextlib

import jax

try:  # a vmap tracer: `val` is the batched value, `batch_dim` its mapped dim
    from jax._src.interpreters.batching import BatchTracer
except ImportError:  # pragma: no cover - moved in some jax version: mapped dims unseen
    class BatchTracer:
        pass


def explicit_axes(mesh) -> frozenset:
    """The names of `mesh`'s axes of type Explicit (none for no mesh or an empty one)."""
    if mesh is None or getattr(mesh, "empty", True):
        return frozenset()
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == jax.sharding.AxisType.Explicit)


def typed_sharding(x):
    """x's sharding when its type is on a mesh with Explicit axes (sharding in types, as
    `jax.make_mesh` makes by default), else None."""
    sh = getattr(jax.typeof(x), "sharding", None)
    return sh if explicit_axes(getattr(sh, "mesh", None)) else None


def varying_axes(*trees) -> tuple:
    """The manual mesh axes any array in `trees` varies over (sorted)."""
    axes = set()
    for x in jax.tree.leaves(trees):
        aval = jax.typeof(x)
        mat = getattr(aval, "mat", None)   # the type's manual axes (newer JAX), or its vma
        axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
    return tuple(sorted(axes, key=str))


def vary(tree, axes):
    """Every array in `tree` typed as varying over `axes` (cast where it does not already)."""
    if not axes:
        return tree

    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)
    return jax.tree.map(one, tree)


def _unchecked():
    try:
        from jax._src import config as jconfig
        return jconfig._check_vma(False)
    except (ImportError, AttributeError):  # pragma: no cover - moved in some JAX version
        return contextlib.nullcontext()


def kernel_call(fn, *args):
    """``fn(*args)``, a kernel call, with operands and results typed as the module says."""
    axes = varying_axes(args)
    if not axes:
        return fn(*args)
    args = vary(args, axes)
    with _unchecked():
        out = fn(*args)
    return vary(out, axes)
