"""Score / mask mods emitted as CuTe DSL operations while a kernel is traced.

The kernel's config carries a mod as a canonical program (`jaxflash.kernels.variants.
mod_program`: equations over float32 / int32 / bool scalars, aux arrays read by clamped
element loads). Here each equation becomes one or a few DSL operations on the accumulator
fragment, element by element, with the element's coordinates from `TileCoords` (the same map
the causal / ALiBi masks use).

Equations are evaluated at the outermost level their inputs allow: those of (b, h) only once
per call (e.g. a per-head slope load), those of the query position once per row a thread owns,
those of the key position once per column (e.g. a document id load shared by the thread's
rows), and only the rest per element. Plain Python, inlined while the kernel is traced.

The element's score is the scaled logit (raw Q K^T times the softmax scale) in float32; the
caller then runs the softmax on natural-log units. Integer division truncates and the
remainder takes the dividend's sign, as in XLA; division by a literal multiplies by its
reciprocal (at most 1 ulp from the quotient, as XLA's GPU fast-math division).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from jaxflash.kernels.common.layouts import acc_as_rows_cols

LOG2_E = math.log2(math.e)
POSITIONS = ("s", "b", "h", "q", "k")


def dependencies(prog) -> dict:
    """Which of s / b / h / q / k each value depends on (aux arrays are static)."""
    deps = {n: ({n} if n in POSITIONS else set()) for n, _, _ in prog.inputs}
    for e in prog.eqns:
        deps[e.out] = set().union(*[deps[a] for a in e.args if isinstance(a, str)])
    return deps


def _type(name: str):
    return {"f32": Float32, "i32": Int32, "bool": Boolean}[name]


def _lit(a):
    return _type(a[1])(a[0])


def _dtype_of(a, types):
    return types[a] if isinstance(a, str) else a[1]


def _select(c, x, y):
    """c ? x : y, typed like x."""
    return type(x)(cutlass.select_(c, x, y))


def _emit(e, args, dts, aux, shapes):
    """The DSL value of equation `e` on argument values `args` (their dtypes `dts`)."""
    p = e.prim
    x = args[0] if args else None
    fl = dts and dts[0] == "f32"
    if p == "ds":
        t = aux[e.args[0]]
        idx = [cutlass.min(cutlass.max(i, Int32(0)), Int32(n - 1))
               for i, n in zip(args[1:], shapes[e.args[0]])]
        return t[idx[0]] if len(idx) == 1 else t[tuple(idx)]
    if p == "neg":
        return -x
    if p == "abs":
        return cute.arch.fmax(x, -x) if fl else _select(x < Int32(0), -x, x)
    if p == "sign":
        zero = Float32(0.0) if fl else Int32(0)
        one = Float32(1.0) if fl else Int32(1)
        return _select(x > zero, one, _select(x < zero, -one, zero))
    if p in ("floor", "ceil", "sqrt", "rsqrt"):
        return getattr(cute.math, p)(x)
    if p == "round":
        # From the truncation, whose remainder x - t is exact (x + 0.5 would round): half away
        # from zero (lax.round's default), or to even (param "even": jnp.round's).
        t = cute.math.trunc(x)
        d = cute.arch.fmax(x - t, t - x)
        up = d >= Float32(0.5)
        if e.param == "even":
            odd = (t - Float32(2.0) * cute.math.trunc(t * Float32(0.5))) != Float32(0.0)
            up = (d > Float32(0.5)) | ((d == Float32(0.5)) & odd)
        step = _select(x < Float32(0.0), Float32(-1.0), Float32(1.0))
        return _select(up, t + step, t)
    if p == "exp":
        return cute.math.exp2(x * Float32(LOG2_E), fastmath=True)
    if p == "exp2":
        return cute.math.exp2(x, fastmath=True)
    if p == "expm1":
        return cute.math.exp2(x * Float32(LOG2_E), fastmath=True) - Float32(1.0)
    if p == "log":
        return cute.math.log(x, fastmath=True)
    if p == "log1p":
        return cute.math.log(x + Float32(1.0), fastmath=True)
    if p == "tanh":
        return cute.math.tanh(x, fastmath=True)
    if p == "logistic":
        return Float32(1.0) / (Float32(1.0) + cute.math.exp2(-x * Float32(LOG2_E),
                                                             fastmath=True))
    if p == "not":
        return _select(x, Boolean(False), Boolean(True)) if dts[0] == "bool" else ~x
    if p == "square":
        return x * x
    if p == "one_minus_square":
        return Float32(1.0) - x * x
    if p == "integer_pow":
        r = x
        for _ in range(abs(e.param) - 1):
            r = r * x
        if e.param == 0:
            return Float32(1.0) if fl else Int32(1)
        return Float32(1.0) / r if e.param < 0 else r
    if p == "convert_element_type":
        if e.param == "bool":
            return x != (Float32(0.0) if fl else Int32(0))
        if dts[0] == "bool":
            one, zero = (Float32(1.0), Float32(0.0)) if e.param == "f32" else (Int32(1), Int32(0))
            return _select(x, one, zero)
        return _type(e.param)(x)
    if p == "select_n":
        if dts[0] == "bool":
            return _select(x, args[2], args[1])
        r = args[1]
        for i, c in enumerate(args[2:], start=1):
            r = _select(x == Int32(i), c, r)
        return r
    if p == "clamp":  # clamp(lo, x, hi)
        lo, v, hi = args
        if dts[1] == "f32":
            return cute.arch.fmin(cute.arch.fmax(v, lo), hi)
        return cutlass.min(cutlass.max(v, lo), hi)
    y = args[1]
    if p == "add":
        return x + y
    if p == "sub":
        return x - y
    if p == "mul":
        return x * y
    if p == "max":
        return cute.arch.fmax(x, y) if fl else cutlass.max(x, y)
    if p == "min":
        return cute.arch.fmin(x, y) if fl else cutlass.min(x, y)
    if p == "div":
        if fl:
            if not isinstance(e.args[1], str):  # a literal divisor: times its reciprocal
                return x * Float32(1.0 / e.args[1][0])
            return x / y
        return (x - x % y) // y  # truncating: x - rem is an exact multiple of y
    if p == "rem":
        if fl:
            return x - cute.math.trunc(x / y) * y
        return x % y
    if p in ("and", "or", "xor"):
        return {"and": x & y, "or": x | y, "xor": x ^ y}[p]
    if p in ("eq", "ne", "lt", "le", "gt", "ge"):
        return {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y,
                "ge": x >= y}[p]
    raise NotImplementedError(f"primitive '{p}' has no CuTe emission")


class ModEvaluator:
    """Evaluates a program's equations into an environment, outermost level first."""

    def __init__(self, prog, aux: dict):
        self.prog = prog
        self.aux = aux  # aux input name -> cute.Tensor
        self.shapes = {n: s for n, _, s in prog.inputs}
        self.types = {n: d for n, d, _ in prog.inputs}
        for e in prog.eqns:
            self.types[e.out] = e.dtype
        self.deps = dependencies(prog)

    def fill(self, env: dict, allowed: set) -> dict:
        """env plus every equation not yet in it whose inputs lie in `allowed`."""
        env = dict(env)
        for e in self.prog.eqns:
            if e.out in env or not self.deps[e.out] <= allowed:
                continue
            vals = [env[a] if isinstance(a, str) else _lit(a)
                    for a in (e.args[1:] if e.prim == "ds" else e.args)]
            if e.prim == "ds":
                vals = [None] + vals
            dts = [_dtype_of(a, self.types) for a in e.args]
            env[e.out] = _emit(e, vals, dts, self.aux, self.shapes)
        return env

    def out(self, env: dict, i: int):
        a = self.prog.outs[i]
        return env[a] if isinstance(a, str) else _lit(a)


def _walk(ev: ModEvaluator, acc, coords, row_start, col_start, b, h, transposed: bool, body):
    """Call body(env, r, j) for every element of the (rows, cols) view of ``acc``, env holding
    every value of the program except those that need the score. Rows are queries (columns
    keys), or the reverse when `transposed` (the backward's S^T tiles)."""
    s = acc_as_rows_cols(acc)
    t0 = coords.t0
    rname, cname = ("k", "q") if transposed else ("q", "k")
    env0 = ev.fill({"b": b, "h": h}, {"b", "h"})
    rows = []
    for r in range(cute.size(s, mode=[0])):
        rows.append(ev.fill({**env0, rname: row_start + coords.row(r)}, {"b", "h", rname}))
    col0 = col_start + coords.base_col
    for j in range(cute.size(s, mode=[1])):
        cenv = ev.fill({**env0, cname: col0 + t0[0, j][1]}, {"b", "h", cname})
        for r in range(cute.size(s, mode=[0])):
            body({**rows[r], **cenv}, s, r, j)


def apply_score_mod(prog, aux: dict, acc, coords, row_start: Int32, col_start: Int32,
                    b: Int32, h: Int32, scale: Float32, transposed: bool = False, grad=None):
    """acc[i, j] <- score_mod(acc[i, j] * scale, b, h, q, k) in place. With `grad` (the
    program then has two outputs, value and derivative by the score), grad(r, j, d) is
    called with each element's derivative (r, j: its place in the (rows, cols) view), so the
    caller can fold it into what it holds there instead of keeping another fragment live."""
    ev = ModEvaluator(prog, aux)

    def body(env, s, r, j):
        env = ev.fill({**env, "s": s[r, j] * scale}, set(POSITIONS))
        s[r, j] = ev.out(env, 0)
        if grad is not None:
            grad(r, j, ev.out(env, 1))

    _walk(ev, acc, coords, row_start, col_start, b, h, transposed, body)


def apply_mask_mod(prog, aux: dict, acc, coords, row_start: Int32, col_start: Int32,
                   b: Int32, h: Int32, transposed: bool = False):
    """acc[i, j] <- -inf where mask_mod(b, h, q, k) is False (one select per element)."""
    ev = ModEvaluator(prog, aux)
    neg_inf = Float32(-Float32.inf)

    def body(env, s, r, j):
        env = ev.fill(env, set(POSITIONS))
        s[r, j] = Float32(cutlass.select_(ev.out(env, 0), s[r, j], neg_inf))

    _walk(ev, acc, coords, row_start, col_start, b, h, transposed, body)
