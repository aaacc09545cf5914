"""Score / mask mods as kernel programs: a closed jaxpr brought into a small canonical text
(DSL-free), the text parsed back into equations, and a NumPy evaluator of those equations.

A mod is a JAX function of scalars: ``score_mod(score, b, h, q_idx, kv_idx, *aux)`` or
``mask_mod(b, h, q_idx, kv_idx, *aux)`` (score float32, indices int32, aux small arrays).
`program_text` traces nothing itself: it takes the mod's closed jaxpr, inlines nested calls
(``jit``, ``custom_jvp_call``), folds constants, removes dead and repeated equations and names
every value by position, so two traces of the same code give the same text. The text is what a
kernel variant is (a config field, so it is in the variant key); the aux *values* never are,
only their shapes and dtypes (the kernel reads them from device memory: new values never
recompile).

What a kernel can do with it is a fixed set of scalar primitives (`SUPPORTED`); anything else
is refused with ``NotImplementedError`` naming the primitive, so dispatch falls back visibly.
Aux arrays may only be read by ``dynamic_slice`` of size 1 per dim (what ``aux[i, j]`` with
scalar indices traces to), which clamps its start indices into range as XLA does: a kernel
load can never leave the array.

Text format, one item per line::

    in s:f32[] b:i32[] h:i32[] q:i32[] k:i32[] x0:f32[8,129]
    v0:i32 = sub q k
    v1:f32 = ds x0 h v0
    out v1

Atoms are value names or literals ``<repr>:<dtype>``. `evaluate` runs the equations with
NumPy in float32 / int32 with XLA's semantics (integer division truncates, remainder takes
the dividend's sign): the reference the kernel emitter (`jaxflash.kernels.common.mod_emit`)
is checked against, equation by equation.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Optional

import numpy as np
from jax import lax

from jaxflash.mods.spec import INLINE_CALLS, SHARDING_IDENTITY

DTYPES = {"float32": "f32", "int32": "i32", "bool": "bool"}
# Element-wise primitives a kernel emits, by arity class.
UNARY = ("neg", "abs", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p",
         "expm1", "tanh", "logistic", "sqrt", "rsqrt", "not", "square", "integer_pow",
         "one_minus_square")
BINARY = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor")
# Spellings of supported primitives (jvp jaxprs sum tangents with add_any).
_ALIASES = {"add_any": "add"}
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
OTHER = ("select_n", "clamp", "convert_element_type", "ds")
SUPPORTED = UNARY + BINARY + COMPARE + OTHER
# Primitives whose inner jaxpr is inlined, and shape-only primitives that are the identity on
# the scalars (size-1 arrays) a mod computes with.
_INLINE = INLINE_CALLS        # (shared with the Pallas kernels' translator)
_IDENTITY = ("squeeze", "reshape", "broadcast_in_dim", "copy", "copy_p",
             "optimization_barrier") + SHARDING_IDENTITY

SCORE_INPUTS = ("s", "b", "h", "q", "k")
MASK_INPUTS = ("b", "h", "q", "k")


@dataclasses.dataclass(frozen=True)
class Eqn:
    out: str
    dtype: str                   # f32 / i32 / bool
    prim: str
    args: tuple                  # value names (str) or literals (value, dtype)
    param: Any = None            # integer_pow: y; convert_element_type: new dtype


@dataclasses.dataclass(frozen=True)
class Program:
    inputs: tuple                # (name, dtype, shape)
    eqns: tuple
    outs: tuple                  # atoms

    @property
    def aux(self) -> tuple:
        """(dtype, shape) of each aux input, in order."""
        return tuple((d, s) for n, d, s in self.inputs if n.startswith("x"))

    def uses(self, name: str) -> bool:
        """Whether an output depends on input `name` (a kernel skips computing unused ones)."""
        needed = {a for a in self.outs if isinstance(a, str)}
        for e in reversed(self.eqns):
            if e.out in needed:
                needed.update(a for a in e.args if isinstance(a, str))
        return name in needed


# -- jaxpr -> text ---------------------------------------------------------------------------
def _dt(aval, what: str) -> str:
    name = str(aval.dtype)
    if name not in DTYPES:
        raise NotImplementedError(f"mods compute in float32 / int32 / bool; {what} is {name}")
    return DTYPES[name]


def _lit(value, dtype: str):
    v = np.asarray(value).reshape(())
    if dtype == "f32":
        return (float(np.float32(v)), "f32")
    if dtype == "i32":
        return (int(np.int32(v)), "i32")
    return (bool(v), "bool")


def _fmt_atom(a) -> str:
    if isinstance(a, str):
        return a
    return f"{a[0]!r}:{a[1]}"


_I32 = (-2 ** 31, 2 ** 31 - 1)
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


class _Builder:
    """Emits equations with constant folding, common-subexpression reuse and integer interval
    tracking: b, h, q_idx, kv_idx are never negative, so the wrap-around of a negative index
    (``lt i 0`` / ``add`` / ``select_n`` per index, what jnp indexing traces to) folds away,
    and the text does not depend on how a jax version spells it."""

    def __init__(self):
        self.eqns: list[Eqn] = []
        self.cse: dict = {}
        self.shapes: dict[str, tuple] = {}
        self.ranges: dict[str, tuple] = {}
        self.dtypes: dict[str, str] = {}
        self.count = 0

    def range_of(self, a):
        if isinstance(a, str):
            return self.ranges.get(a, _I32)
        return (int(a[0]), int(a[0])) if a[1] == "i32" else _I32

    def _fold(self, prim: str, args: tuple, dtype: str):
        """A literal or an argument when the intervals (or an identity: x + 0, x * 1, a
        conversion to the same dtype) decide the result, else None."""
        if prim == "convert_element_type" and isinstance(args[0], str) and \
                self.dtypes.get(args[0]) == dtype:
            return args[0]
        if prim in ("add", "sub", "mul") and len(args) == 2:
            unit = 1 if prim == "mul" else 0
            lit = [not isinstance(a, str) and a[0] == unit for a in args]
            if lit[1]:
                return args[0]
            if lit[0] and prim != "sub":
                return args[1]
        if prim == "select_n" and not isinstance(args[0], str):
            return args[1 + int(args[0][0])]
        if prim == "select_n" and all(a == args[1] for a in args[2:]):
            return args[1]
        if prim in _FLIP and len(args) == 2 and all(
                isinstance(a, str) or a[1] == "i32" for a in args):
            (alo, ahi), (blo, bhi) = self.range_of(args[0]), self.range_of(args[1])
            known = {"lt": (ahi < blo, alo >= bhi), "le": (ahi <= blo, alo > bhi),
                     "gt": (alo > bhi, ahi <= blo), "ge": (alo >= bhi, ahi < blo),
                     "eq": (alo == ahi == blo == bhi, ahi < blo or alo > bhi),
                     "ne": (ahi < blo or alo > bhi, alo == ahi == blo == bhi)}[prim]
            if known[0]:
                return (True, "bool")
            if known[1]:
                return (False, "bool")
        return None

    def _range(self, prim: str, args: tuple):
        r = [self.range_of(a) for a in args]
        lo = hi = None
        if prim == "add":
            lo, hi = r[0][0] + r[1][0], r[0][1] + r[1][1]
        elif prim == "sub":
            lo, hi = r[0][0] - r[1][1], r[0][1] - r[1][0]
        elif prim == "max":
            lo, hi = max(r[0][0], r[1][0]), max(r[0][1], r[1][1])
        elif prim == "min":
            lo, hi = min(r[0][0], r[1][0]), min(r[0][1], r[1][1])
        elif prim == "clamp":  # clamp(lo, x, hi) = min(max(x, lo), hi), bound by bound
            lo = min(max(r[1][0], r[0][0]), r[2][0])
            hi = min(max(r[1][1], r[0][1]), r[2][1])
        elif prim == "abs":
            lo, hi = (0 if r[0][0] <= 0 <= r[0][1] else min(abs(r[0][0]), abs(r[0][1])),
                      max(abs(r[0][0]), abs(r[0][1])))
        elif prim == "select_n":
            lo, hi = min(x[0] for x in r[1:]), max(x[1] for x in r[1:])
        if lo is None or lo < _I32[0] or hi > _I32[1]:
            return _I32
        return (lo, hi)

    def emit(self, prim: str, args: tuple, dtype: str, param=None):
        # Constant folding: every argument a literal (no aux read) -> a literal.
        if prim != "ds" and all(not isinstance(a, str) for a in args):
            e = Eqn("_", dtype, prim, args, param)
            return _lit(_apply(e, [np.asarray(a[0], _NP[a[1]]) for a in args], {}), dtype)
        folded = self._fold(prim, args, dtype)
        if folded is not None:
            return folded
        # (literals by their text: 0.0 and -0.0 are equal but not the same operand)
        key = (prim, tuple(_fmt_atom(a) for a in args), dtype, param)
        if key in self.cse:
            return self.cse[key]
        name = f"v{self.count}"
        self.count += 1
        self.eqns.append(Eqn(name, dtype, prim, args, param))
        self.cse[key] = name
        self.dtypes[name] = dtype
        if dtype == "i32":
            self.ranges[name] = self._range(prim, args)
        return name


def _walk(jaxpr, consts, env, b: _Builder):
    def read(atom):
        if hasattr(atom, "val"):  # Literal
            return _lit(atom.val, _dt(atom.aval, "a literal"))
        return env[atom]

    for v, c in zip(jaxpr.constvars, consts):
        if np.ndim(c) != 0:
            raise NotImplementedError(
                "a mod captured an array constant of shape "
                f"{np.shape(c)}: pass arrays as aux (kernel inputs), not closures")
        env[v] = _lit(c, _dt(v.aval, "a captured constant"))
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        prim = _ALIASES.get(prim, prim)
        args = [read(a) for a in eqn.invars]
        if prim in _INLINE:
            inner = eqn.params[_INLINE[prim]]
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = getattr(inner, "consts", ())
            sub = dict(zip(inner_jaxpr.invars, args))
            _walk(inner_jaxpr, inner_consts, sub, b)
            for o, io in zip(eqn.outvars, inner_jaxpr.outvars):
                env[o] = sub[io] if not hasattr(io, "val") else _lit(io.val, _dt(io.aval, "x"))
            continue
        if prim in _IDENTITY:
            src = args[0]
            if isinstance(src, str) and b.shapes.get(src, ()) and \
                    int(np.prod(b.shapes[src])) != 1:
                raise NotImplementedError(
                    f"{prim} of a whole aux array: aux arrays can only be indexed with scalar "
                    "indices in a mod")
            for o, a in zip(eqn.outvars, args):   # (pvary takes several operands)
                env[o] = a
            continue
        if prim == "dynamic_slice":
            arr, idx = args[0], args[1:]
            if not (isinstance(arr, str) and arr.startswith("x")):
                raise NotImplementedError("dynamic_slice of a computed value (only aux arrays "
                                          "can be indexed)")
            if any(s != 1 for s in eqn.params["slice_sizes"]):
                raise NotImplementedError(
                    f"a slice of size {eqn.params['slice_sizes']} of an aux array: a mod reads "
                    "single elements")
            env[eqn.outvars[0]] = b.emit("ds", (arr,) + tuple(idx),
                                         _dt(eqn.outvars[0].aval, "an aux element"))
            continue
        if prim == "pow":
            raise NotImplementedError("primitive 'pow' (x ** y with a float exponent) cannot be "
                                      "translated; use exp(y * log(x))")
        if prim not in SUPPORTED:
            hint = (" (jnp.take, .at[].get and fancy indexing trace to it: read aux elements "
                    "as aux[i] / aux[i, j])" if prim in ("gather", "slice", "concatenate")
                    else "")
            raise NotImplementedError(
                f"primitive '{prim}' cannot be translated into a CuTe kernel{hint} (a mod may "
                f"use {', '.join(SUPPORTED[:-1])}, and aux[i, ...] reads)")
        for a in args:
            if isinstance(a, str) and a.startswith("x"):
                raise NotImplementedError(f"{prim} of a whole aux array: aux arrays can only "
                                          "be indexed with scalar indices in a mod")
        out = eqn.outvars[0]
        if tuple(getattr(out.aval, "shape", ())) not in ((),) and \
                int(np.prod(out.aval.shape)) != 1:
            raise NotImplementedError(f"{prim} makes an array of shape {out.aval.shape}: a mod "
                                      "computes with scalars")
        param = None
        if prim == "integer_pow":
            param = int(eqn.params["y"])
        elif prim == "convert_element_type":
            param = _dt(out.aval, "a conversion target")
        elif prim == "round" and _half_even(eqn.params.get("rounding_method")):
            param = "even"   # (away from zero, lax.round's default, has no param)
        env[out] = b.emit(prim, tuple(args), _dt(out.aval, f"the result of {prim}"), param)


def _half_even(method) -> bool:
    """Whether a round's ``rounding_method`` (a `lax.RoundingMethod`) is TO_NEAREST_EVEN
    (jnp.round's, jnp.rint's), not AWAY_FROM_ZERO."""
    return method is not None and int(method) == int(lax.RoundingMethod.TO_NEAREST_EVEN)


def program_from_jaxpr(closed, kind: str) -> Program:
    """The canonical `Program` of a mod's closed jaxpr (`kind`: "score" or "mask"; a "score"
    jaxpr may have extra outputs, e.g. the derivative from `jax.jvp`)."""
    names = SCORE_INPUTS if kind == "score" else MASK_INPUTS
    jaxpr = closed.jaxpr
    b = _Builder()
    env = {}
    inputs = []
    for i, v in enumerate(jaxpr.invars):
        name = names[i] if i < len(names) else f"x{i - len(names)}"
        shape = tuple(int(d) for d in getattr(v.aval, "shape", ()))
        dt = _dt(v.aval, f"input {name}")
        want = "f32" if name == "s" else ("i32" if i < len(names) else None)
        if want is not None and (dt != want or shape != ()):
            raise ValueError(f"mod input {name} must be a {want} scalar, got {dt}{list(shape)}")
        inputs.append((name, dt, shape))
        env[v] = name
        b.shapes[name] = shape
        b.dtypes[name] = dt
        if name in MASK_INPUTS:  # batch, head and positions are never negative
            b.ranges[name] = (0, _I32[1])
    _walk(jaxpr, closed.consts, env, b)
    outs = []
    for o in jaxpr.outvars:
        if hasattr(o, "val"):
            outs.append(_lit(o.val, _dt(o.aval, "an output")))
        else:
            outs.append(env[o])
    prog = Program(tuple(inputs), tuple(b.eqns), tuple(outs))
    return _dce(prog)


def _dce(p: Program) -> Program:
    needed = {a for a in p.outs if isinstance(a, str)}
    keep = []
    for e in reversed(p.eqns):
        if e.out in needed:
            keep.append(e)
            needed.update(a for a in e.args if isinstance(a, str))
    # renumber in order so the text does not depend on what was dropped
    ren = {n: n for n, _, _ in p.inputs}
    eqns = []
    for i, e in enumerate(reversed(keep)):
        ren[e.out] = f"v{i}"
        eqns.append(Eqn(f"v{i}", e.dtype, e.prim,
                        tuple(ren[a] if isinstance(a, str) else a for a in e.args), e.param))
    outs = tuple(ren[a] if isinstance(a, str) else a for a in p.outs)
    return Program(p.inputs, tuple(eqns), outs)


def to_text(p: Program) -> str:
    lines = ["in " + " ".join(f"{n}:{d}[{','.join(map(str, s))}]" for n, d, s in p.inputs)]
    for e in p.eqns:
        par = "" if e.param is None else f"[{e.param}]"
        lines.append(f"{e.out}:{e.dtype} = {e.prim}{par} "
                     + " ".join(_fmt_atom(a) for a in e.args))
    lines.append("out " + " ".join(_fmt_atom(a) for a in p.outs))
    return "\n".join(lines)


def _parse_atom(s: str):
    if ":" not in s:
        return s
    v, d = s.rsplit(":", 1)
    if d == "f32":
        return (float(v), d)
    if d == "i32":
        return (int(v), d)
    return (v == "True", d)


def parse(text: str) -> Program:
    """The `Program` of `to_text`'s output (what a kernel reads from its config)."""
    lines = text.strip().splitlines()
    inputs = []
    for tok in lines[0].split()[1:]:
        name, rest = tok.split(":")
        dt, shape = rest.split("[")
        shape = tuple(int(x) for x in shape.rstrip("]").split(",") if x)
        inputs.append((name, dt, shape))
    eqns = []
    for line in lines[1:-1]:
        lhs, rhs = line.split(" = ")
        out, dt = lhs.split(":")
        head, *args = rhs.split()
        param = None
        if "[" in head:
            head, p = head.rstrip("]").split("[")
            param = int(p) if head == "integer_pow" else p
        eqns.append(Eqn(out, dt, head, tuple(_parse_atom(a) for a in args), param))
    outs = tuple(_parse_atom(a) for a in lines[-1].split()[1:])
    return Program(tuple(inputs), tuple(eqns), outs)


def digest(*texts: Optional[str]) -> str:
    """Short hash of mod texts, for readable variant keys."""
    h = hashlib.sha256("\n--\n".join(t or "" for t in texts).encode()).hexdigest()
    return h[:10]


# -- NumPy semantics ---------------------------------------------------------------------------
_NP = {"f32": np.float32, "i32": np.int32, "bool": np.bool_}


def _apply(e: Eqn, a: list, aux: dict):
    """One equation on NumPy values (XLA's semantics, float32 / int32 arithmetic)."""
    p = e.prim
    with np.errstate(all="ignore"):
        if p == "ds":
            arr = aux[e.args[0]]
            idx = tuple(int(np.clip(i, 0, n - 1)) for i, n in zip(a[1:], arr.shape))
            return arr[idx]
        x = a[0]
        if p == "neg":
            return -x
        if p == "abs":
            return np.abs(x)
        if p == "sign":
            return np.sign(x)
        if p in ("floor", "ceil"):
            return getattr(np, p)(x)
        if p == "round":
            if e.param == "even":
                return np.rint(x)
            # half away from zero, in float64 (x + 0.5 rounds in float32)
            x64 = np.float64(x)
            return np.float32(np.sign(x64) * np.floor(np.abs(x64) + 0.5))
        if p in ("exp", "exp2", "log", "log1p", "expm1", "tanh", "sqrt"):
            return getattr(np, p)(x)
        if p == "logistic":
            return np.float32(1) / (np.float32(1) + np.exp(-x))
        if p == "rsqrt":
            return np.float32(1) / np.sqrt(x)
        if p == "not":
            return np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)
        if p == "square":
            return x * x
        if p == "one_minus_square":
            return np.float32(1) - x * x
        if p == "integer_pow":
            r = np.ones_like(x)
            for _ in range(abs(e.param)):
                r = r * x
            return r if e.param >= 0 else np.float32(1) / r
        if p == "convert_element_type":
            if e.param == "i32" and x.dtype == np.float32:
                # saturating, NaN to 0 (XLA's convert; the kernels' cvt.rzi.s32.f32)
                if np.isnan(x):
                    return np.int32(0)
                return np.int32(np.clip(np.trunc(np.float64(x)), _I32[0], _I32[1]))
            return x.astype(_NP[e.param])
        if p == "select_n":
            return a[1 + int(x)]
        if p == "clamp":
            return np.minimum(np.maximum(a[1], x), a[2])
        y = a[1]
        if p in ("add", "sub", "mul", "max", "min"):
            return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
                    "min": np.minimum}[p](x, y)
        if p == "div":
            if x.dtype == np.int32:
                return np.int32(np.trunc(np.float64(x) / np.float64(y))) if y else np.int32(-1)
            return x / y
        if p == "rem":
            return np.fmod(x, y) if (x.dtype != np.int32 or y) else x
        if p in ("and", "or", "xor"):
            f = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
            g = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}
            return (f if x.dtype == np.bool_ else g)[p](x, y)
        if p in COMPARE:
            return {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                    "gt": np.greater, "ge": np.greater_equal}[p](x, y)
    raise NotImplementedError(f"primitive '{p}'")


def evaluate(p: Program, scalars: dict, aux: tuple = ()) -> tuple:
    """The program's outputs for one element: `scalars` maps s / b / h / q / k to numbers,
    `aux` the aux arrays in order (NumPy, float32 / int32 arithmetic)."""
    env = {}
    auxd = {}
    i = 0
    for name, dt, shape in p.inputs:
        if name.startswith("x"):
            auxd[name] = np.asarray(aux[i], _NP[dt])
            i += 1
        else:
            env[name] = _NP[dt](scalars[name])

    def val(a):
        return env[a] if isinstance(a, str) else _NP[a[1]](a[0])

    for e in p.eqns:
        args = [None] + [val(a) for a in e.args[1:]] if e.prim == "ds" else \
            [val(a) for a in e.args]
        env[e.out] = np.asarray(_apply(e, args, auxd)).astype(_NP[e.dtype])[()]
    return tuple(val(a) for a in p.outs)


# -- tracing a mod -----------------------------------------------------------------------------
def _avals(aux) -> list:
    import jax
    return [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in aux]


def score_program(fn, aux=(), with_grad: bool = False) -> Program:
    """`fn(score, b, h, q_idx, kv_idx, *aux)` as a Program; with_grad: two outputs, the value
    and d(value)/d(score) (`with_derivative`, for the backward kernel). `aux`: arrays or
    ShapeDtypeStructs (only shapes and dtypes are used)."""
    import jax
    import jax.numpy as jnp
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    i32 = jax.ShapeDtypeStruct((), jnp.int32)

    def value(s, b, h, q, k, *xs):
        return jnp.asarray(fn(s, b, h, q, k, *xs), jnp.float32)

    closed = jax.make_jaxpr(value)(f32, i32, i32, i32, i32, *_avals(aux))
    prog = program_from_jaxpr(closed, "score")
    return with_derivative(prog) if with_grad else prog


def mask_program(fn, aux=()) -> Program:
    """`fn(b, h, q_idx, kv_idx, *aux)` (True = attend) as a Program."""
    import jax
    import jax.numpy as jnp
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    closed = jax.make_jaxpr(lambda b, h, q, k, *xs: jnp.asarray(fn(b, h, q, k, *xs), bool))(
        i32, i32, i32, i32, *_avals(aux))
    return program_from_jaxpr(closed, "mask")


def mod_aux(text: str) -> tuple:
    """(dtype name, shape) of a program text's aux inputs, read from its first line."""
    if not text:
        return ()
    names = {"f32": "float32", "i32": "int32", "bool": "bool"}
    return tuple((names[d], s) for n, d, s in parse_inputs(text) if n.startswith("x"))


def parse_inputs(text: str) -> tuple:
    first = text.strip().splitlines()[0]
    out = []
    for tok in first.split()[1:]:
        name, rest = tok.split(":")
        dt, shape = rest.split("[")
        out.append((name, dt, tuple(int(x) for x in shape.rstrip("]").split(",") if x)))
    return tuple(out)


def kernel_programs(score_text: str, mask_text: str) -> tuple:
    """(score Program or None, mask Program or None, aux input names, (in_scale, out_scale)):
    what a kernel's config holds, parsed for its emitter; the score program with its constant
    factors moved out (`factor_scales`: the kernel multiplies the raw scores by the softmax
    scale times in_scale, and the exp2 by log2(e) times out_scale)."""
    sp = parse(score_text) if score_text else None
    mp = parse(mask_text) if mask_text else None
    first = sp or mp
    names = tuple(n for n, _, _ in first.inputs if n.startswith("x")) if first else ()
    scales = (1.0, 1.0)
    if sp is not None:
        sp, a, c = factor_scales(sp)
        scales = (a, c)
    return sp, mp, names, scales


_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _custom_rules(jaxpr) -> set:
    """The custom-derivative call primitives a jaxpr holds (nested calls too)."""
    found = set()
    for e in jaxpr.eqns:
        if e.primitive.name in _CUSTOM_RULES:
            found.add(e.primitive.name)
        inner = e.params.get(INLINE_CALLS.get(e.primitive.name, ""), None)
        if inner is not None:
            found |= _custom_rules(getattr(inner, "jaxpr", inner))
    return found


def spec_texts(spec) -> dict:
    """A call's `jaxflash.mods.ModSpec` as kernel program texts: "score" (value), "score_grad"
    (value and d/d score) and "mask" ("" where absent); {} without mods. NotImplementedError
    names what a kernel cannot compute (dispatch then falls back)."""
    if spec is None:
        return {}
    return _spec_texts(spec)


@functools.lru_cache(maxsize=256)
def _spec_texts(spec) -> dict:
    from jaxflash.mods import spec as mods
    for shape, dtype in spec.aux_avals:
        if str(dtype) not in ("float32", "int32"):
            raise NotImplementedError(f"an aux array of dtype {dtype} (shape {shape}): the "
                                      "CuTe kernels read float32 / int32 aux arrays")
    out = {"score": "", "score_grad": "", "mask": ""}
    if spec.has_score:
        prog = program_from_jaxpr(mods.score_jaxpr(spec), "score")
        out["score"] = to_text(prog)
        rules = _custom_rules(mods.score_jaxpr(spec).jaxpr)
        if rules & {"custom_vjp_call", "custom_vjp_call_jaxpr"}:
            raise NotImplementedError(
                "the score_mod calls a jax.custom_vjp function: its reverse-mode rule has no "
                "form the kernels' backward (a derivative by the score) can take")
        if rules:
            # A derivative rule of the user's (jax.custom_jvp: a straight-through estimator,
            # relu's at 0) is not the primal body's derivative: take jax.jvp's, which applies
            # it.
            out["score_grad"] = to_text(program_from_jaxpr(mods.score_deriv_jaxpr(spec),
                                                           "score"))
        else:
            out["score_grad"] = to_text(with_derivative(prog))
    if spec.has_mask:
        out["mask"] = to_text(program_from_jaxpr(mods.mask_jaxpr(spec), "mask"))
    return out


def factor_scales(p: Program) -> tuple:
    """(program, in_scale, out_scale): constant factors moved out of a score program where it
    multiplies or divides the score by a literal before anything else reads it (a softcap's
    ``score / c``: the kernel folds it into the softmax scale it multiplies the raw scores by
    anyway) or its value output is a literal times a value (the softcap's ``c * tanh``: the
    kernel folds it into the exp2 factor). Then program(s) == out_scale * program'(s *
    in_scale) for the value, other outputs unchanged: softcap as a mod costs what the
    built-in does."""
    in_scale, out_scale = 1.0, 1.0
    eqns = list(p.eqns)
    uses = [e for e in eqns if "s" in e.args]
    ren = {}
    if len(uses) == 1 and uses[0].prim in ("mul", "div") and uses[0].dtype == "f32" \
            and "s" not in p.outs:
        e = uses[0]
        other = e.args[1] if e.args[0] == "s" else e.args[0]
        if not isinstance(other, str) and (e.prim == "mul" or e.args[0] == "s") and other[0]:
            in_scale = other[0] if e.prim == "mul" else 1.0 / other[0]
            ren[e.out] = "s"
            eqns.remove(e)
    outs = list(p.outs)
    last = {e.out: e for e in eqns}.get(outs[0]) if isinstance(outs[0], str) else None
    if last is not None and last.prim == "mul" and outs[0] not in outs[1:] and not any(
            last.out in e.args for e in eqns):
        lits = [a for a in last.args if not isinstance(a, str)]
        # (a positive factor only: the kernel takes each row's max before scaling)
        if len(lits) == 1 and 0 < lits[0][0] < math.inf:
            out_scale = lits[0][0]
            outs[0] = next(a for a in last.args if isinstance(a, str))
            eqns.remove(last)
    fix = lambda a: ren.get(a, a) if isinstance(a, str) else a
    eqns = tuple(dataclasses.replace(e, args=tuple(fix(a) for a in e.args)) for e in eqns)
    return Program(p.inputs, eqns, tuple(fix(a) for a in outs)), in_scale, out_scale


# -- the derivative by the score, by forward-mode differentiation of the program ---------------
def with_derivative(p: Program) -> Program:
    """`p` (one value output) with a second output: d value / d s. Derived here from the
    program, not from `jax.jvp`: jax's JVP rules change between versions (0.11 writes tanh's
    as `one_minus_square`), the primal programs do not, and the text is the variant key a
    machine without the CuTe DSL must reproduce. Ties of max / min / clamp follow jax (half
    to each side at max / min ties, nothing at clamp bounds)."""
    b = _Builder()
    env, tan = {}, {}
    for name, dt, shape in p.inputs:
        env[name] = name
        b.shapes[name] = shape
        b.dtypes[name] = dt
        if name in MASK_INPUTS:
            b.ranges[name] = (0, _I32[1])
    tan["s"] = (1.0, "f32")
    f = lambda v: (float(v), "f32")
    val = lambda a: env[a] if isinstance(a, str) else a
    T = lambda a: tan.get(a) if isinstance(a, str) else None

    def add(x, y):
        return y if x is None else x if y is None else b.emit("add", (x, y), "f32")

    def mul(x, y):
        return None if x is None or y is None else b.emit("mul", (x, y), "f32")

    def sel(pred, x, y):  # pred ? x : y, None as 0
        if x is None and y is None:
            return None
        return b.emit("select_n", (pred, y if y is not None else f(0), x if x is not None
                                   else f(0)), "f32")

    for e in p.eqns:
        args = tuple(val(a) for a in e.args)
        out = b.emit(e.prim, args, e.dtype, e.param)
        env[e.out] = out
        if e.dtype != "f32" or e.prim == "ds":
            continue
        ts = [T(a) for a in e.args]
        if all(t is None for t in ts):
            continue
        x = args[0]
        y = args[1] if len(args) > 1 else None
        ta = ts[0]
        tb = ts[1] if len(ts) > 1 else None
        pr = e.prim
        if pr in ("add", "sub"):
            t = add(ta, b.emit("neg", (tb,), "f32") if pr == "sub" and tb is not None else tb)
        elif pr == "mul":
            t = add(mul(ta, y), mul(x, tb))
        elif pr == "div":
            inv = b.emit("div", (f(1), y), "f32")
            t = add(mul(ta, inv), mul(b.emit("neg", (mul(out, inv),), "f32"), tb))
        elif pr == "neg":
            t = b.emit("neg", (ta,), "f32")
        elif pr == "abs":
            t = sel(b.emit("ge", (x, f(0)), "bool"), ta, b.emit("neg", (ta,), "f32"))
        elif pr in ("max", "min"):
            win = b.emit("gt" if pr == "max" else "lt", (x, y), "bool")
            lose = b.emit("lt" if pr == "max" else "gt", (x, y), "bool")
            half = mul(add(ta, tb), f(0.5))
            t = sel(win, ta, sel(lose, tb, half))
        elif pr in ("floor", "ceil", "round", "sign"):
            t = None
        elif pr == "exp":
            t = mul(out, ta)
        elif pr == "exp2":
            t = mul(mul(out, f(math.log(2.0))), ta)
        elif pr == "expm1":
            t = mul(b.emit("add", (out, f(1)), "f32"), ta)
        elif pr == "log":
            t = mul(ta, b.emit("div", (f(1), x), "f32"))
        elif pr == "log1p":
            t = mul(ta, b.emit("div", (f(1), b.emit("add", (x, f(1)), "f32")), "f32"))
        elif pr == "tanh":
            t = mul(b.emit("sub", (f(1), b.emit("mul", (out, out), "f32")), "f32"), ta)
        elif pr == "one_minus_square":
            t = mul(mul(x, f(-2)), ta)
        elif pr == "logistic":
            t = mul(mul(out, b.emit("sub", (f(1), out), "f32")), ta)
        elif pr == "sqrt":
            t = mul(ta, b.emit("div", (f(0.5), out), "f32"))
        elif pr == "rsqrt":
            t = mul(ta, mul(b.emit("div", (out, x), "f32"), f(-0.5)))
        elif pr == "square":
            t = mul(mul(x, f(2)), ta)
        elif pr == "integer_pow":
            n = e.param
            t = mul(mul(f(n), b.emit("integer_pow", (x,), "f32", n - 1) if n != 1 else f(1)),
                    ta)
        elif pr == "convert_element_type":
            t = ta
        elif pr == "select_n":
            t = None if all(v is None for v in ts[1:]) else b.emit(
                "select_n", (x,) + tuple(v if v is not None else f(0) for v in ts[1:]), "f32")
        elif pr == "clamp":  # clamp(lo, x, hi)
            lo, xx, hi = args
            tlo, tx, thi = ts
            inside = b.emit("and", (b.emit("gt", (xx, lo), "bool"),
                                    b.emit("lt", (xx, hi), "bool")), "bool")
            t = add(add(sel(inside, tx, None), sel(b.emit("gt", (lo, xx), "bool"), tlo, None)),
                    sel(b.emit("lt", (hi, xx), "bool"), thi, None))
        elif pr == "rem":
            q = b.emit("div", (x, y), "f32")
            k = b.emit("mul", (b.emit("sign", (q,), "f32"),
                               b.emit("floor", (b.emit("abs", (q,), "f32"),), "f32")), "f32")
            t = add(ta, mul(b.emit("neg", (k,), "f32"), tb))
        else:
            raise NotImplementedError(f"no derivative rule for primitive '{pr}'")
        if t is not None:
            tan[e.out] = t
    value = val(p.outs[0])
    d = T(p.outs[0]) if isinstance(p.outs[0], str) else None
    return _dce(Program(p.inputs, tuple(b.eqns), (value, d if d is not None else f(0))))
