"""Shared test base: fresh random problems, the reference oracle, and per-dtype tolerances.

Every backend test builds a `Case`, runs the backend through `jaxflash.flash_attention` and
compares with `oracle` (the reference in float32 on the same inputs, upcast). Inputs are fresh
normal draws (never zeros); outputs are checked finite where the reference is finite.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import subprocess
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

# Relative-L2 tolerances against the float32 reference, per input dtype. bf16 has 8 mantissa
# bits: a flash kernel's P is rounded to bf16 before the PV matmul, so errors near 4e-3 are
# normal; fp16 has 11 bits; float32 kernels accumulate in float32 (tf32 excluded).
FWD_TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}
GRAD_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

_counter = itertools.count(1)


def fresh_key():
    """A new PRNG key each call, so each check sees inputs it was never tuned on."""
    return jax.random.key(np.random.SeedSequence().entropy % (2**31) + next(_counter))


@dataclasses.dataclass
class Case:
    B: int = 2
    T: int = 17
    S: int = 17
    N: int = 4
    K: int = 4
    H: int = 32
    Hv: Optional[int] = None
    dtype: str = "float32"
    kwargs: dict = dataclasses.field(default_factory=dict)  # flash_attention keyword args
    bias: bool = False
    mask: bool = False

    def make(self, key=None):
        """Random q, k, v (+ bias/mask when asked), and the call's keyword args."""
        key = fresh_key() if key is None else key
        ks = jax.random.split(key, 6)
        Hv = self.Hv or self.H
        dt = jnp.dtype(self.dtype)
        q = jax.random.normal(ks[0], (self.B, self.T, self.N, self.H), jnp.float32).astype(dt)
        k = jax.random.normal(ks[1], (self.B, self.S, self.K, self.H), jnp.float32).astype(dt)
        v = jax.random.normal(ks[2], (self.B, self.S, self.K, Hv), jnp.float32).astype(dt)
        extra = {}
        if self.bias:
            extra["bias"] = jax.random.normal(ks[3], (self.B, self.N, self.T, self.S)) * 0.5
        if self.mask:
            extra["mask"] = jax.random.bernoulli(ks[4], 0.7, (self.B, 1, self.T, self.S))
        return q, k, v, {**extra, **self.kwargs}


def oracle(q, k, v, **kwargs):
    """The reference on float32-upcast inputs, returning (out float32, lse)."""
    kwargs = dict(kwargs)
    kwargs.pop("implementation", None)
    up = lambda x: x.astype(jnp.float32)
    out, lse = jaxflash.flash_attention(up(q), up(k), up(v), implementation="xla",
                                        return_residual=True, **kwargs)
    return out, lse


def rel_l2(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((x - ref).ravel()) / max(denom, 1e-30))


def assert_sum_close(x, ref, terms, tol, what=""):
    """A scalar that sums `terms` (of both signs, e.g. a loss sum(out * w)) against its
    reference. Its own relative error is unbounded when the terms cancel, and partial sums
    added in another order (sharded, ring) round differently: bound the difference by tol
    times the sum of the terms' magnitudes instead."""
    x, ref = float(jnp.asarray(x, jnp.float32)), float(jnp.asarray(ref, jnp.float32))
    assert np.isfinite(x), f"{what}: {x}"
    scale = float(jnp.sum(jnp.abs(jnp.asarray(terms, jnp.float32))))
    assert abs(x - ref) <= tol * scale, f"{what}: |{x} - {ref}| > {tol:.1e} * {scale:.4g}"


def assert_close(x, ref, tol, what=""):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert x.shape == ref.shape, f"{what}: shape {x.shape} != {ref.shape}"
    fin = np.isfinite(ref)
    assert np.all(np.isfinite(x[fin])), f"{what}: non-finite values where the reference is finite"
    # -inf LSE rows must match exactly.
    assert np.array_equal(np.isneginf(x), np.isneginf(ref)), f"{what}: -inf pattern differs"
    assert not np.any(np.isnan(x)), f"{what}: NaN"
    err = rel_l2(x[fin], ref[fin])
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e}"
    return err


def loss_and_grads(q, k, v, argnums=(0, 1, 2), **kwargs):
    """d/d(q,k,v[,bias]) of a random-projection loss (sum(out * w), w fixed and random)."""
    w = jax.random.normal(jax.random.key(1234), q.shape[:-1] + (v.shape[-1],), jnp.float32)

    def f(q, k, v, bias=None):
        kw = dict(kwargs)
        if bias is not None:
            kw["bias"] = bias
        out = jaxflash.flash_attention(q, k, v, **kw)
        return jnp.sum(out.astype(jnp.float32) * w)

    if "bias" in kwargs and 3 in argnums:
        bias = kwargs.pop("bias")
        return jax.grad(f, argnums=argnums)(q, k, v, bias)
    return jax.grad(f, argnums=argnums)(q, k, v)


def runtime_only(monkeypatch, kernel_dir=None, forbid_compile=True):
    """Simulate a machine without the CuTe DSL (the GPU machine here): the env switch, `import
    cutlass` failing, no compiler, and artifacts read from `kernel_dir` when given."""
    import sys

    import pytest

    from jaxflash.ffi import cache, compiler
    monkeypatch.setenv(cache.ENV_NO_DSL, "1")
    monkeypatch.setitem(sys.modules, "cutlass", None)  # `import cutlass` now raises ImportError
    if forbid_compile:
        monkeypatch.setattr(compiler, "compile_launch",
                            lambda launch: pytest.fail("compiled in runtime-only mode"))
    if kernel_dir is not None:
        monkeypatch.setenv(cache.ENV_KERNEL_DIR, str(kernel_dir))


def ptxas_report(ptx: str, tmp_path):
    """ptxas -v output for the PTX (None if no usable ptxas): the DSL emits a newer PTX ISA
    than the CUDA 13.0 ptxas reads; the kernel uses nothing newer, so the version is lowered."""
    if shutil.which("ptxas") is None:
        return None
    src = re.sub(r"^\.version .*$", ".version 9.0", ptx, count=1, flags=re.M)
    (tmp_path / "k.ptx").write_text(src)
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                        str(tmp_path / "k.cubin")], capture_output=True, text=True)
    return r.stdout + r.stderr if r.returncode == 0 else None
