"""The user's mods inside a kernel tile.

A mod is traced once to a jaxpr on scalars (`jaxflash.mods.score_jaxpr` and friends). Here
that jaxpr is replayed on a tile: each per-element scalar becomes an array that varies only on
the tile axes it depends on (the query index on rows, the key index on columns, the score on
both; ``b`` and ``h`` are program scalars), combined with numpy broadcasting, so a mask that
reads only ``q_idx`` costs one row of work. Reads of an aux array at per-element indices (a
``dynamic_slice`` of size 1, what ``aux[i, j]`` traces to) become loads from the aux operand's
ref at the index arrays: gather loads on Triton, plain indexing in interpret mode. Primitives
with non-scalar per-element operands or control flow are refused with their name
(NotImplementedError), so dispatch can fall back.

Replaying the jaxpr, rather than vmapping the user's function, keeps the kernel free of
``gather`` (which the Triton lowering lacks) and evaluates each value at its own shape.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import mods as _mods
from jaxflash.mods.spec import INLINE_CALLS, SHARDING_IDENTITY

try:  # jax >= 0.4.36 names the literal class here
    from jax.extend.core import Literal as _Literal
except ImportError:  # pragma: no cover
    from jax.core import Literal as _Literal


class _Tile:
    """A per-element value: an array broadcastable to the tile."""
    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v


class _Aux:
    """An aux operand (a ref) or a constant the mod closes over (an array)."""
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


_SHAPE_OPS = ("squeeze", "reshape", "broadcast_in_dim", "expand_dims")
# What a mod may use inside the kernels: element-wise arithmetic that Triton lowers (the
# CuTe kernels' set, `jaxflash.kernels.variants.mod_program.SUPPORTED`, in JAX's names), aux
# reads (size-1 dynamic_slice) and scalar reshapes; nested calls are replayed. Anything else is
# refused by name before a kernel is traced, so dispatch falls back.
_ALLOWED = frozenset((
    "neg", "abs", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sqrt", "rsqrt", "not", "square", "integer_pow",
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "convert_element_type",
    "dynamic_slice", "copy", "copy_p", "stop_gradient") + _SHAPE_OPS
    + SHARDING_IDENTITY)


def _value(x):
    if isinstance(x, _Tile):
        return x.v
    if isinstance(x, _Aux):
        return x.ref[...]
    return x


def _inner(eqn):
    """The body of a call primitive (`jaxflash.mods.spec.INLINE_CALLS`), else None."""
    param = INLINE_CALLS.get(eqn.primitive.name)
    return None if param is None else eqn.params.get(param)


def _eval(jaxpr, consts, args):
    env = {}

    def read(a):
        if isinstance(a, _Literal):
            return jnp.asarray(a.val, a.aval.dtype)
        return env[a]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        outs = _eqn(eqn, ins)
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(a) for a in jaxpr.outvars]


def _eqn(eqn, ins):
    prim = eqn.primitive
    tiled = any(isinstance(x, _Tile) for x in ins)
    inner = _inner(eqn)
    if inner is not None:  # jit / custom_jvp / custom_vjp / remat: replay the body
        closed = inner if hasattr(inner, "consts") else None
        body = closed.jaxpr if closed is not None else inner
        consts = [_Aux(c) if np.ndim(c) else jnp.asarray(c)
                  for c in (closed.consts if closed is not None else ())]
        n = len(body.invars)
        return _eval(body, consts, ins[len(ins) - n:])
    if prim.name in SHARDING_IDENTITY:
        return list(ins)
    if prim.name == "dynamic_slice" and isinstance(ins[0], _Aux):
        return [_gather(eqn, ins)]
    if not tiled:  # only aux / constants / literals: an ordinary computation
        out = prim.bind(*[_value(x) for x in ins], **eqn.params)
        return list(out) if prim.multiple_results else [out]
    if prim.name in _SHAPE_OPS and all(v.aval.size == 1 for v in eqn.outvars):
        return [ins[0]]  # a scalar reshaped: the same per-element value
    scalar = all(getattr(v.aval, "shape", None) == () for v in list(eqn.invars) + eqn.outvars
                 if not isinstance(v, _Literal))
    if not scalar or prim.multiple_results:
        raise NotImplementedError(
            f"mod operation {prim.name!r} on per-element values is not supported in the Pallas "
            f"kernels (elementwise arithmetic, comparisons, where and aux[i, j] reads are)")
    vals = jnp.broadcast_arrays(*[_value(x) for x in ins])
    return [_Tile(prim.bind(*vals, **eqn.params))]


def _gather(eqn, ins):
    """``dynamic_slice(aux, *idx)`` of size 1: a load at the clamped per-element indices."""
    aux, idx = ins[0], ins[1:]
    sizes = eqn.params["slice_sizes"]
    shape = eqn.invars[0].aval.shape
    if any(s != 1 for s in sizes):
        raise NotImplementedError(f"mod reads a {sizes} slice of an aux array of shape {shape}; "
                                  f"the Pallas kernels read single elements (aux[i, j])")
    # dynamic_slice clamps its start indices into range; so do we.
    idx = [jnp.clip(_value(i), 0, d - 1).astype(jnp.int32) for i, d in zip(idx, shape)]
    idx = jnp.broadcast_arrays(*idx) if idx else []
    if isinstance(aux.ref, (np.ndarray, jax.Array)):
        val = jnp.asarray(aux.ref)[tuple(idx)]
    else:
        val = aux.ref[tuple(idx)]
    return _Tile(val)


class ModTile(NamedTuple):
    """One program's view of the mods: the spec, its batch row and query head (scalars) and
    the aux refs."""

    spec: object
    b: object
    h: object
    aux: tuple


def _run(closed, scalars, aux_refs):
    consts = [_Aux(c) if np.ndim(c) else jnp.asarray(c) for c in closed.consts]
    args = [_Tile(jnp.asarray(x)) for x in scalars] + [_Aux(r) for r in aux_refs]
    return [_value(o) for o in _eval(closed.jaxpr, consts, args)]


def score(mt: ModTile, s, qi, ki, with_deriv: bool = False):
    """score_mod on the tile ``s`` (natural-log units, float32) at broadcastable query / key
    indices; with_deriv: also d(score_mod)/d(score) (for the backward's dS)."""
    spec = mt.spec
    closed = _mods.score_deriv_jaxpr(spec) if with_deriv else _mods.score_jaxpr(spec)
    outs = _run(closed, (s, mt.b, mt.h, qi, ki), mt.aux)
    outs = [jnp.broadcast_to(o.astype(jnp.float32), s.shape) for o in outs]
    return (outs[0], outs[1]) if with_deriv else outs[0]


def mask(mt: ModTile, qi, ki, shape) -> Optional[object]:
    """mask_mod at broadcastable query / key indices, as a bool array of `shape`."""
    (out,) = _run(_mods.mask_jaxpr(mt.spec), (mt.b, mt.h, qi, ki), mt.aux)
    return jnp.broadcast_to(out, shape)


def whole_inputs(ops: dict, prefixes: tuple[str, ...]):
    """(names, arrays, BlockSpecs) of the operands in `ops` whose names start with one of
    `prefixes` (aux leaves ``aux<i>``, block-mask lists ``bm_*`` / ``bmt_*``), each passed
    whole to every program (they are small: read at per-element or per-tile indices)."""
    from jax.experimental import pallas as pl
    names, args, specs = [], [], []
    for name in sorted(ops, key=_order):
        if name.startswith(prefixes):
            x = ops[name]
            names.append(name)
            args.append(x)
            specs.append(pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd))
    return names, args, specs


def _order(name):
    # aux10 after aux9: numeric order for the leaves, names for the rest.
    digits = "".join(c for c in name if c.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


def _walk(closed, prims: set, consts: list) -> None:
    """Every primitive of a ClosedJaxpr and its nested calls into `prims`, the shapes of the
    array constants they close over into `consts`."""
    consts += [np.shape(c) for c in getattr(closed, "consts", ()) if np.ndim(c)]
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        inner = _inner(eqn)
        if inner is not None:
            _walk(inner, prims, consts)
        else:
            prims.add(eqn.primitive.name)


@functools.lru_cache(maxsize=256)
def check(spec) -> None:
    """Raise NotImplementedError (naming the operation) if these kernels cannot run `spec`'s
    mods: every operation must be one they translate, arrays must come in as aux (a Pallas
    kernel takes arrays only as operands), and the jaxprs are replayed abstractly on a small
    tile, as the kernels will (once per spec: a refusal is not cached, a pass is)."""
    for shape, dtype in spec.aux_avals:
        if jnp.dtype(dtype) == jnp.bool_:
            raise NotImplementedError(f"a boolean aux array {shape}: the Triton kernels have "
                                      f"no boolean memory type (pass it as int8 or int32)")
    prims, consts = set(), []
    for closed in ((_mods.score_deriv_jaxpr(spec),) if spec.has_score else ()) + (
            (_mods.mask_jaxpr(spec),) if spec.has_mask else ()):
        _walk(closed, prims, consts)
    bad = sorted(prims - _ALLOWED)
    if bad:
        raise NotImplementedError(
            f"mod operations {bad} are not supported in the Pallas kernels (element-wise "
            f"arithmetic, comparisons, where and aux[i, j] reads are)")
    if consts:
        raise NotImplementedError(
            f"a mod captured array constants of shapes {consts}: pass arrays as aux (the "
            f"Pallas kernels take arrays only as operands)")

    def probe(*aux):
        mt = ModTile(spec, jnp.int32(0), jnp.int32(0), tuple(aux))
        qi = jnp.arange(16, dtype=jnp.int32)[:, None]
        ki = jnp.arange(16, dtype=jnp.int32)[None, :]
        out = []
        if spec.has_score:
            out += list(score(mt, jnp.zeros((16, 16), jnp.float32), qi, ki, with_deriv=True))
        if spec.has_mask:
            out.append(mask(mt, qi, ki, (16, 16)))
        return out

    jax.eval_shape(probe, *spec.aux_shape_structs())
