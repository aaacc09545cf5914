"""The CuTe emission of mod programs (`jaxflash.kernels.common.mod_emit`), evaluated in Python.

The emitter builds DSL values with a handful of DSL calls (``Float32`` / ``Int32`` / ``Boolean``
arithmetic, ``cutlass.select_`` / ``min`` / ``max``, ``cute.arch.fmax`` / ``fmin``,
``cute.math.*``, aux tensor indexing). Here those names are replaced by NumPy stand-ins with the
DSL's semantics (``//`` on Int32 floors, ``%`` truncates: MLIR's ``floordivsi`` / ``remsi``),
so the very code that emits a kernel's operations runs on numbers and is compared with JAX
on the mod itself: the order of a select's operands, truncating division, the clamp of aux
indices, a literal divisor's reciprocal, the per-level evaluation, all in one check.
"""
from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

from jaxflash.kernels.common import mod_emit  # noqa: E402
from jaxflash.kernels.variants import mod_program as mp  # noqa: E402
from tests.kernels.test_mod_translate import MASK_MODS, SCORE_MODS, _elements  # noqa: E402


class I32:
    """Int32 with the DSL's operators (wrapping int32; floor division, truncated remainder)."""

    def __init__(self, v):
        if isinstance(v, I32):
            v = v.v
        elif isinstance(v, (float, np.floating)):
            v = np.trunc(v)  # fptosi
        self.v = np.int32(np.int64(v))

    def _b(self, o, f):
        o = o.v if isinstance(o, I32) else np.int32(o)
        with np.errstate(all="ignore"):
            return I32(f(np.int32(self.v), np.int32(o)))

    def __add__(self, o): return self._b(o, lambda a, b: a + b)
    def __sub__(self, o): return self._b(o, lambda a, b: a - b)
    def __mul__(self, o): return self._b(o, lambda a, b: a * b)
    def __floordiv__(self, o): return self._b(o, lambda a, b: a // b)
    def __mod__(self, o): return self._b(o, lambda a, b: np.fmod(a, b))
    def __and__(self, o): return self._b(o, np.bitwise_and)
    def __or__(self, o): return self._b(o, np.bitwise_or)
    def __xor__(self, o): return self._b(o, np.bitwise_xor)
    def __neg__(self): return I32(-self.v)
    def __invert__(self): return I32(~self.v)
    def __lt__(self, o): return np.bool_(self.v < I32(o).v)
    def __le__(self, o): return np.bool_(self.v <= I32(o).v)
    def __gt__(self, o): return np.bool_(self.v > I32(o).v)
    def __ge__(self, o): return np.bool_(self.v >= I32(o).v)
    def __eq__(self, o): return np.bool_(self.v == I32(o).v)
    def __ne__(self, o): return np.bool_(self.v != I32(o).v)
    __hash__ = None


def F32(x):
    return np.float32(x.v if isinstance(x, I32) else x)


class Tensor:
    def __init__(self, a):
        self.a = np.asarray(a)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        v = self.a[tuple(int(i.v) for i in idx)]
        return I32(v) if self.a.dtype == np.int32 else np.float32(v)


def _fm(f):
    return lambda x, fastmath=False: np.float32(f(np.float32(x)))


@pytest.fixture
def numpy_dsl(monkeypatch):
    cutlass = types.SimpleNamespace(
        select_=lambda c, x, y: x if bool(c) else y,
        min=lambda a, b: I32(min(a.v, b.v)) if isinstance(a, I32) else np.minimum(a, b),
        max=lambda a, b: I32(max(a.v, b.v)) if isinstance(a, I32) else np.maximum(a, b))
    cute = types.SimpleNamespace(
        arch=types.SimpleNamespace(fmax=lambda a, b: np.float32(np.fmax(a, b)),
                                   fmin=lambda a, b: np.float32(np.fmin(a, b))),
        math=types.SimpleNamespace(
            exp2=_fm(np.exp2), log=_fm(np.log), tanh=_fm(np.tanh), floor=_fm(np.floor),
            ceil=_fm(np.ceil), sqrt=_fm(np.sqrt), rsqrt=_fm(lambda x: 1 / np.sqrt(x)),
            trunc=_fm(np.trunc)))
    for name, val in (("cutlass", cutlass), ("cute", cute), ("Float32", F32), ("Int32", I32),
                      ("Boolean", np.bool_)):
        monkeypatch.setattr(mod_emit, name, val)


def _emitted(prog, el, aux, i):
    ev = mod_emit.ModEvaluator(prog, {n: Tensor(a) for n, a in zip(
        [n for n, _, _ in prog.inputs if n.startswith("x")], aux)})
    env = {n: (F32(el[n][i]) if n == "s" else I32(el[n][i])) for n in "sbhqk" if n in el}
    # outermost levels first, as the kernels evaluate them
    env = ev.fill(env, {"b", "h"})
    env = ev.fill(env, {"b", "h", "q"})
    env = ev.fill(env, set(mod_emit.POSITIONS))
    out = [ev.out(env, j) for j in range(len(prog.outs))]
    return [o.v if isinstance(o, I32) else o for o in out]


@pytest.mark.parametrize("name, fn, make_aux", SCORE_MODS, ids=[c[0] for c in SCORE_MODS])
def test_emitted_score_mods_match_jax(numpy_dsl, name, fn, make_aux):
    rng = np.random.default_rng(5)
    aux = make_aux(rng)
    el = _elements(rng, 128)
    # what the backward kernel emits: the value-and-derivative program with its constant
    # factors moved out (the kernel scales the raw scores by in_scale, the exp2 by out_scale)
    text = mp.to_text(mp.score_program(fn, aux, with_grad=True))
    prog, _, _, (a, c) = mp.kernel_programs(text, "")
    args = [jnp.asarray(el[n]) for n in "sbhqk"]
    want = np.asarray(jax.jit(jax.vmap(lambda *a: fn(*a, *aux)))(*args))
    dwant = np.asarray(jax.jit(jax.vmap(jax.grad(lambda *a: fn(*a, *aux))))(*args))
    auxn = [np.asarray(a) for a in aux]
    el = {**el, "s": el["s"] * np.float32(a)}
    got = np.array([_emitted(prog, el, auxn, i) for i in range(128)], np.float32)
    np.testing.assert_allclose(got[:, 0] * np.float32(c), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 1], dwant, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, fn, make_aux", MASK_MODS, ids=[c[0] for c in MASK_MODS])
def test_emitted_mask_mods_match_jax(numpy_dsl, name, fn, make_aux):
    rng = np.random.default_rng(6)
    aux = make_aux(rng)
    el = _elements(rng, 128)
    el.pop("s")
    prog = mp.mask_program(fn, aux)
    want = np.asarray(jax.jit(jax.vmap(lambda *a: fn(*a, *aux)))(
        *[jnp.asarray(el[n]) for n in "bhqk"]))
    auxn = [np.asarray(a) for a in aux]
    got = np.array([bool(_emitted(prog, el, auxn, i)[0]) for i in range(128)])
    assert (got == want).all()


def test_softcap_factors_fold_into_the_softmax_scales():
    """Softcap as a mod leaves only the tanh in the element loop (the built-in's cost): its
    1 / cap goes into the raw-score factor, its cap into the exp2 factor."""
    prog, _, _, (a, c) = mp.kernel_programs(mp.to_text(mp.score_program(
        lambda s, b, h, q, k: 20.0 * jnp.tanh(s / 20.0))), "")
    assert [e.prim for e in prog.eqns] == ["tanh"] and (a, c) == (1 / 20.0, 20.0)


def test_aux_reads_are_clamped(numpy_dsl):
    """An index past the aux array reads its last element (XLA's dynamic_slice clamps the
    same way): a kernel load never leaves the array."""
    t = np.arange(10, dtype=np.float32)
    prog = mp.score_program(lambda s, b, h, q, k, t: s + t[q + k], (jnp.asarray(t),))
    el = dict(s=np.zeros(1, np.float32), b=[0], h=[0], q=[7], k=[500])
    assert _emitted(prog, el, [t], 0)[0] == 9.0
    assert math.isclose(mp.evaluate(prog, dict(s=0, b=0, h=0, q=7, k=500), [t])[0], 9.0)
