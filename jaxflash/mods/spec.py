"""`ModSpec`: the normalized, hashable description of a call's custom attention.

A user writes ``score_mod(score, b, h, q_idx, kv_idx, *aux) -> float`` and / or
``mask_mod(b, h, q_idx, kv_idx, *aux) -> bool`` as ordinary JAX functions of scalars (``score``
float32, the indices int32) and passes the arrays they read as ``aux`` (a tuple of pytrees).
Every backend sees the same `ModSpec`; the aux arrays travel separately, as runtime operands.

What is static and what is not:

- The mods' *code* is static: each is traced once to a jaxpr on scalar int32 / float32 inputs
  and the aux leaves' shapes and dtypes (`score_jaxpr`, `mask_jaxpr`). `ModSpec.key` is a sha256
  over those jaxprs' text, the values of any arrays they close over (constants compiled into
  the code), and the aux avals. Two specs are equal exactly when their keys are, so a mod
  re-created per call (a lambda) hits the same caches, and a changed mod changes the key.
  Whether an eager call traces a mod anew is decided by the Python values it reads
  (`_python_constants`); a NumPy array of more than 65,536 elements among them is told apart by
  identity, not content: change such an array by replacing it, or pass it as aux.
- Floating aux leaves narrower than float32 are read in float32 (as the kernels compute mods),
  so a learnable bf16 table's gradient accumulates in float32 before it is cast back.
- The aux *values* are runtime arrays: they never enter the key, so changing them (a learnable
  relative-position table after an optimizer step, other document boundaries) never recompiles.
- A mod that closes over a traced value (an array from the enclosing ``jax.jit``) cannot be
  compiled in; it is refused with the hint to pass it through ``aux``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

# What the translators of a mod's jaxpr into kernel code (CuTe, Pallas) do with nested
# jaxprs: these call primitives are inlined where they stand (primitive -> the parameter that
# holds the body). Loops (`scan`, `while`) and branches (`cond`) also carry bodies but are not
# calls: replaying a body once would compute something else, so they are refused by name.
INLINE_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                "remat": "jaxpr", "checkpoint": "jaxpr"}
# Sharding annotations JAX adds to a mod traced inside `shard_map` or under explicit sharding
# (its derivative's `reshard`, `pvary`): the identity on the scalars a mod computes with.
SHARDING_IDENTITY = ("reshard", "pvary", "pbroadcast", "sharding_constraint", "mesh_cast")

_I32 = jax.ShapeDtypeStruct((), jnp.int32)
_F32 = jax.ShapeDtypeStruct((), jnp.float32)


def normalize_aux(aux) -> tuple:
    """``aux`` as the tuple the mods receive as ``*aux``: None -> (), one array -> (array,),
    a list -> tuple; a tuple stays (its elements may be any pytrees of arrays)."""
    if aux is None:
        return ()
    if isinstance(aux, tuple):
        return aux
    if isinstance(aux, list):
        return tuple(aux)
    return (aux,)


@dataclasses.dataclass(frozen=True, eq=False)
class ModSpec:
    """The mods of one call (either may be None) and the static structure of their aux.

    ``aux_tree`` is the treedef of the aux tuple, ``aux_avals`` ``((shape, dtype), ...)`` of its
    leaves in flattening order; `aux` rebuilds the tuple from the leaves. Equality and hash
    follow ``key`` (see the module docstring)."""

    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    aux_tree: Any
    aux_avals: tuple
    key: str

    def __eq__(self, other):
        return isinstance(other, ModSpec) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        names = [f"{n}={getattr(f, '__name__', type(f).__name__)}"
                 for n, f in (("score_mod", self.score_mod), ("mask_mod", self.mask_mod)) if f]
        return f"ModSpec({', '.join(names)}, aux={list(self.aux_avals)}, key={self.key[:12]})"

    def aux(self, leaves) -> tuple:
        """The aux tuple (as the mods receive it) from its flat leaves."""
        return jax.tree_util.tree_unflatten(self.aux_tree, list(leaves))

    @property
    def has_score(self) -> bool:
        return self.score_mod is not None

    @property
    def has_mask(self) -> bool:
        return self.mask_mod is not None

    def flat_score(self) -> Optional[Callable]:
        """score_mod over flat aux leaves: ``f(score, b, h, q_idx, kv_idx, *leaves)``."""
        if self.score_mod is None:
            return None
        return _flat(self.score_mod, self.aux_tree, 5)

    def flat_mask(self) -> Optional[Callable]:
        """mask_mod over flat aux leaves: ``f(b, h, q_idx, kv_idx, *leaves)``."""
        if self.mask_mod is None:
            return None
        return _flat(self.mask_mod, self.aux_tree, 4)

    def aux_shape_structs(self) -> list:
        return [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in self.aux_avals]

    def float_aux(self) -> tuple[bool, ...]:
        """Per leaf: whether it is floating (so it can have a gradient)."""
        return tuple(jnp.issubdtype(jnp.dtype(d), jnp.floating) for _, d in self.aux_avals)


def _flat(fn, tree, nargs):
    def f(*args):
        # jnp.asarray: a mod may return a Python number (a constant logit, True)
        return jnp.asarray(fn(*args[:nargs],
                              *jax.tree_util.tree_unflatten(tree, list(args[nargs:]))))
    f.__name__ = getattr(fn, "__name__", "mod")
    return f


def make_spec(score_mod=None, mask_mod=None, aux=()) -> tuple[Optional[ModSpec], tuple]:
    """``(spec, aux_leaves)`` for a call; ``(None, ())`` when neither mod is given.

    Raises ValueError when a mod is not callable, returns the wrong kind of value (score_mod:
    one floating scalar; mask_mod: one boolean scalar), cannot be traced on scalars, or closes
    over a traced array (pass such arrays through ``aux``)."""
    aux = normalize_aux(aux)
    if score_mod is None and mask_mod is None:
        if aux:
            raise ValueError("aux was given without score_mod or mask_mod to read it")
        return None, ()
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable or None; got {fn!r}")
    leaves, tree = jax.tree_util.tree_flatten(aux)
    avals = []
    for x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = np.asarray(x)
        if np.dtype(x.dtype).kind not in "biuf" and not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"aux leaves must be numeric or boolean arrays; got {x.dtype} "
                             f"({x!r:.60})")
        # a symbolic dim (jax.export shape polymorphism) stays symbolic: only the XLA
        # reference serves such calls, and its name keys them
        avals.append((tuple(int(d) if isinstance(d, (int, np.integer)) else d for d in x.shape),
                      str(_compute_dtype(x.dtype))))
    # Floating leaves narrower than float32 are read in float32, as the kernels compute mods:
    # a learnable bf16 table's gradient then sums its many (query, key) contributions in
    # float32 and comes back (through the cast) in the leaf's dtype.
    leaves = [jnp.asarray(x).astype(_compute_dtype(x.dtype)) for x in leaves]
    avals = tuple(avals)
    h = hashlib.sha256()
    h.update(repr(avals).encode())
    h.update(str(tree).encode())
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        h.update(name.encode())
        if fn is not None:
            h.update(_jaxpr_digest(fn, _python_constants(fn), tree, avals, name).encode())
    spec = ModSpec(score_mod, mask_mod, tree, avals, h.hexdigest())
    return spec, tuple(leaves)


def _compute_dtype(dtype):
    """The dtype a mod reads an aux leaf in: as jnp.asarray makes it, floats at least 32-bit."""
    d = jax.dtypes.canonicalize_dtype(dtype)
    if jnp.issubdtype(d, jnp.floating) and np.dtype(d).itemsize < 4:
        return np.dtype(np.float32)
    return d


_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
# Modules whose functions a mod calls as library code: their internals are not the mod's.
_LIBRARIES = ("jax", "jaxlib", "numpy", "builtins", "math", "operator", "functools")
_SMALL_ARRAY = 1 << 16   # elements of a NumPy array read whole into the key
_MISSING = object()


def _python_constants(fn) -> tuple:
    """The Python values a mod reads that may change between calls while the function object
    stays: scalars, NumPy scalars and small NumPy arrays (by content), JAX arrays (by
    identity), reached through the globals its code names (module attributes too), its
    closure cells, helper functions it calls, `functools.partial` arguments, bound methods'
    instances, and the tuples / lists / dicts of mods that `chain` / `and_masks` close over.
    Part of the trace cache's key, so an eager call after such a value changes traces (and
    compiles) anew instead of reusing the mod's old trace."""
    return _reads(fn, 0, set())


def _reads(obj, depth: int, seen: set):
    if isinstance(obj, _SCALARS):
        return obj.item() if isinstance(obj, np.generic) else obj
    if depth > 8 or id(obj) in seen:
        return None
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        if obj.size <= _SMALL_ARRAY:
            return ("np", obj.shape, str(obj.dtype), hashlib.sha256(obj.tobytes()).hexdigest())
        return ("np", id(obj))
    if isinstance(obj, jax.Array):
        return ("jax", id(obj))
    if isinstance(obj, (tuple, list)):
        return tuple(_reads(x, depth + 1, seen) for x in obj[:64])
    if isinstance(obj, dict):
        return tuple((repr(k), _reads(v, depth + 1, seen)) for k, v in list(obj.items())[:64])
    if isinstance(obj, functools.partial):
        return (_reads(obj.func, depth + 1, seen), _reads(obj.args, depth + 1, seen),
                _reads(obj.keywords, depth + 1, seen))
    if inspect.ismethod(obj):
        return (_reads(obj.__func__, depth + 1, seen),
                _reads(getattr(obj.__self__, "__dict__", None), depth + 1, seen))
    if inspect.isfunction(obj):
        if (getattr(obj, "__module__", None) or "").split(".")[0] in _LIBRARIES:
            return None
        code, glb = obj.__code__, obj.__globals__
        names = _names(code)
        out = []
        for n in names:
            if n not in glb:
                continue
            v = glb[n]
            if inspect.ismodule(v) or isinstance(v, type) or _plain_object(v):
                # a module's, a class's or an object's attributes the code may read (the
                # code's names hold attribute names too)
                out.extend((n, a, _reads(getattr(v, a), depth + 1, seen)) for a in names
                           if _readable_attr(v, a))
            else:
                out.append((n, _reads(v, depth + 1, seen)))
        for cell in obj.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                out.append(None)
                continue
            if _plain_object(v):   # an object the closure holds: the attributes the code names
                out.append(tuple((a, _reads(getattr(v, a), depth + 1, seen)) for a in names
                                 if _readable_attr(v, a)))
            else:
                out.append(_reads(v, depth + 1, seen))
        return tuple(out)
    if isinstance(obj, type):   # a class a closure holds: its own scalar attributes
        return tuple((a, _reads(v, depth + 1, seen)) for a, v in vars(obj).items()
                     if isinstance(v, _SCALARS + (np.ndarray,)))
    if callable(obj) and hasattr(obj, "__dict__"):   # a callable object: its and its class's
        cls = type(obj)
        return (cls.__qualname__, _reads(cls.__call__, depth + 1, seen),
                _reads(obj.__dict__, depth + 1, seen),
                tuple((a, _reads(v, depth + 1, seen)) for a, v in vars(cls).items()
                      if isinstance(v, _SCALARS + (np.ndarray,))))
    return None


def _plain_object(v) -> bool:
    """An object that is not a value `_reads` reads whole (a config instance, say)."""
    return not (callable(v) or inspect.ismodule(v) or isinstance(
        v, _SCALARS + (np.ndarray, jax.Array, tuple, list, dict, type)))


def _readable_attr(v, a: str) -> bool:
    x = getattr(v, a, _MISSING)
    return isinstance(x, _SCALARS + (np.ndarray,)) or inspect.isfunction(x)


def _names(code) -> tuple:
    """The global and attribute names a code object reads, its nested functions' (a lambda
    defined inside the mod) included."""
    out = list(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            out.extend(_names(c))
    return tuple(dict.fromkeys(out))


@functools.lru_cache(maxsize=512)
def _jaxpr_digest(fn, constants, tree, avals, name) -> str:
    # Cached per function object and the Python constants it reads (`_python_constants`): a
    # call in a training loop traces its mods once.
    closed = _trace(fn, tree, avals, name)
    h = hashlib.sha256(str(closed.jaxpr).encode())
    for c in closed.consts:
        if isinstance(c, jax.core.Tracer):
            raise ValueError(
                f"{name} closes over a traced array (shape {c.shape}, {c.dtype}); a mod's "
                f"closure is compiled into the kernel, so values that change must be passed "
                f"through aux=(...) and read from the mod's *aux arguments")
        a = np.asarray(c)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _trace(fn, tree, avals, name):
    structs = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in avals]
    nargs = 5 if name == "score_mod" else 4
    scalars = ([_F32] if nargs == 5 else []) + [_I32] * 4
    try:
        closed, out = jax.make_jaxpr(_flat(fn, tree, nargs), return_shape=True)(*scalars,
                                                                                 *structs)
    except Exception as e:  # noqa: BLE001 - the user's function: say which one, keep the cause
        raise ValueError(f"{name} could not be traced on scalar int32 indices"
                         + (" and a float32 score" if nargs == 5 else "")
                         + f" with aux leaves {list(avals)}: {type(e).__name__}: {e}") from e
    want = "a floating" if nargs == 5 else "a boolean"
    ok = (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
          and (jnp.issubdtype(out.dtype, jnp.floating) if nargs == 5 else out.dtype == jnp.bool_))
    if not ok:
        raise ValueError(f"{name} must return {want} scalar; got {out}")
    return closed


@functools.lru_cache(maxsize=512)
def _cached_jaxpr(spec: ModSpec, name: str, deriv: bool):
    fn = spec.score_mod if name == "score_mod" else spec.mask_mod
    if fn is None:
        return None
    if not deriv:
        return _trace(fn, spec.aux_tree, spec.aux_avals, name)
    flat = _flat(fn, spec.aux_tree, 5)

    def value_and_dscore(s, *rest):
        out, d = jax.jvp(lambda x: flat(x, *rest).astype(jnp.float32), (s,), (jnp.float32(1),))
        return out, d

    try:
        return jax.make_jaxpr(value_and_dscore)(_F32, *([_I32] * 4), *spec.aux_shape_structs())
    except Exception as e:  # noqa: BLE001 - jax's refusal (a callback, a custom_vjp)
        # the kernels need this derivative; a backend asking for it then declines the call
        raise NotImplementedError(f"the score_mod has no derivative by the score that a kernel "
                                  f"can compute: {type(e).__name__}: {str(e)[:200]}") from e


def score_jaxpr(spec: ModSpec):
    """The score_mod's ClosedJaxpr on ``(score f32[], b, h, q_idx, kv_idx i32[], *aux
    leaves)`` -> one float scalar; None without a score_mod. What kernel code generators
    translate; `ModSpec.key` covers its text."""
    return _cached_jaxpr(spec, "score_mod", False)


def score_deriv_jaxpr(spec: ModSpec):
    """Like `score_jaxpr` with two float32 outputs: the modded score and its derivative with
    respect to ``score`` (what the backward's dS is multiplied by)."""
    return _cached_jaxpr(spec, "score_mod", True)


def mask_reads(spec: ModSpec) -> frozenset:
    """Which of the batch and head indices (``"b"``, ``"h"``) the mask_mod reads: a block
    mask built for one batch element or head serves the others only where it reads neither."""
    closed = mask_jaxpr(spec)
    if closed is None:
        return frozenset()
    jaxpr = closed.jaxpr
    try:  # dead code dropped first (jax's own pass; private, so with a fallback)
        from jax._src.interpreters.partial_eval import dce_jaxpr
        used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[1]
        return frozenset(n for n, u in zip(("b", "h"), used[:2]) if u)
    except (ImportError, AttributeError, TypeError):
        pass
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    return frozenset(n for n, v in zip(("b", "h"), jaxpr.invars[:2]) if id(v) in used)


def mask_jaxpr(spec: ModSpec):
    """The mask_mod's ClosedJaxpr on ``(b, h, q_idx, kv_idx i32[], *aux leaves)`` -> one
    bool scalar; None without a mask_mod."""
    return _cached_jaxpr(spec, "mask_mod", False)
