"""Shared test base: fresh random problems, the reference oracle, and per-dtype tolerances.

Every backend test builds a `Case`, runs the backend through `jaxflash.flash_attention` and
compares with `oracle` (the reference in float32 on the same inputs, upcast). Inputs are fresh
normal draws (never zeros); outputs are checked finite where the reference is finite.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import itertools
import os
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


# Test inputs are drawn in NumPy: an eager jax.random draw compiles an XLA program for every new
# shape (1-3 s of CPU each on the 2-core machine, several per test), a NumPy draw costs nothing.
def fresh_rng():
    """A new NumPy generator each call (fresh OS entropy), like `fresh_key`."""
    return np.random.default_rng(np.random.SeedSequence().entropy + next(_counter))


def randn(shape, dtype="float32", rng=None, scale=1.0):
    """Fresh normal draws (standard deviation `scale`) of `shape`, a jax array of `dtype`."""
    x = (rng or fresh_rng()).standard_normal(shape, np.float32) * np.float32(scale)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def bernoulli(p, shape, rng=None):
    """Fresh booleans, True with probability p."""
    return jnp.asarray((rng or fresh_rng()).random(shape) < p)


def randint(low, high, shape, rng=None):
    """Fresh int32 in [low, high)."""
    return jnp.asarray((rng or fresh_rng()).integers(low, high, shape).astype(np.int32))


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
        """Random q, k, v (+ bias/mask when asked), and the call's keyword args. Drawn in NumPy
        from fresh entropy (`randn`), or with jax.random from `key` when one is given."""
        Hv = self.Hv or self.H
        shapes = [(self.B, self.T, self.N, self.H), (self.B, self.S, self.K, self.H),
                  (self.B, self.S, self.K, Hv), (self.B, self.N, self.T, self.S),
                  (self.B, 1, self.T, self.S)]
        if key is None:  # (casts and scaling in NumPy too: eagerly, each would compile)
            rng = fresh_rng()
            normal = lambda i, dt="float32", c=1.0: jnp.asarray(
                (rng.standard_normal(shapes[i], np.float32) * np.float32(c)).astype(dt))
            bern = lambda p: jnp.asarray(rng.random(shapes[4]) < p)
        else:
            ks = jax.random.split(key, 6)
            normal = lambda i, dt="float32", c=1.0: (
                jax.random.normal(ks[i], shapes[i], jnp.float32) * c).astype(dt)
            bern = lambda p: jax.random.bernoulli(ks[4], p, shapes[4])
        dt = jnp.dtype(self.dtype)
        q, k, v = (normal(i, dt) for i in range(3))
        extra = {}
        if self.bias:
            extra["bias"] = normal(3, c=0.5)
        if self.mask:
            extra["mask"] = bern(0.7)
        return q, k, v, {**extra, **self.kwargs}


def split_kwargs(kwargs):
    """flash_attention keyword args -> (array operands, static options): the arrays become
    arguments of a jitted check, the rest is closed over."""
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray))}
    return arrays, {n: x for n, x in kwargs.items() if n not in arrays}


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
    x, ref = float(_f32(x)), float(_f32(ref))
    assert np.isfinite(x), f"{what}: {x}"
    scale = float(np.sum(np.abs(_f32(terms))))
    assert abs(x - ref) <= tol * scale, f"{what}: |{x} - {ref}| > {tol:.1e} * {scale:.4g}"


def _f32(x):
    """float32 NumPy copy (the cast in NumPy: eagerly in jax it would compile per shape)."""
    return np.asarray(x).astype(np.float32)


def assert_close(x, ref, tol, what=""):
    x, ref = _f32(x), _f32(ref)
    assert x.shape == ref.shape, f"{what}: shape {x.shape} != {ref.shape}"
    fin = np.isfinite(ref)
    assert np.all(np.isfinite(x[fin])), f"{what}: non-finite values where the reference is finite"
    # -inf LSE rows must match exactly.
    assert np.array_equal(np.isneginf(x), np.isneginf(ref)), f"{what}: -inf pattern differs"
    assert not np.any(np.isnan(x)), f"{what}: NaN"
    err = rel_l2(x[fin], ref[fin])
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e}"
    return err


def assert_forward_close(out, lse, ref_out, ref_lse, dtype: str):
    """A forward's (out, lse) against the oracle's: finite output within the dtype's
    tolerance, -inf LSE exactly where the reference has it, finite LSE within 1e-4."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all()
    assert_close(out, ref_out, FWD_TOL[dtype], "out")
    fin = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(lse)) == fin).all()
    assert_close(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], 1e-4, "lse")


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


def ptxas_report(ptx: str, tmp_path, arch: str = "sm_90a"):
    """ptxas -v output for the PTX (None if no usable ptxas): the DSL emits a newer PTX ISA
    than the CUDA 13.0 ptxas reads; the kernel uses nothing newer, so the version is lowered."""
    if shutil.which("ptxas") is None:
        return None
    src = re.sub(r"^\.version .*$", ".version 9.0", ptx, count=1, flags=re.M)
    (tmp_path / "k.ptx").write_text(src)
    r = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(tmp_path / "k.ptx"), "-o",
                        str(tmp_path / "k.cubin")], capture_output=True, text=True)
    return r.stdout + r.stderr if r.returncode == 0 else None


def cuda_tool(name: str):
    """nvdisasm / cuobjdump: $NVDISASM / $CUOBJDUMP, PATH, or the pip wheels the test extra
    installs (nvidia-cuda-nvdisasm, nvidia-cuda-cuobjdump); None if absent."""
    found = os.environ.get(name.upper()) or shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for cand in glob.glob(os.path.join(root, "*", "bin", name)):
            return cand
    return None


def sass_opcodes(cubin) -> Optional[collections.Counter]:
    """Static count of each SASS opcode with its upper-case modifiers (``MUFU.EX2``,
    ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C``; a shape such as ``QGMMA.64x128x32`` ends at
    its first digit group) in a cubin, predicates dropped; None without nvdisasm."""
    nvdisasm = cuda_tool("nvdisasm")
    if nvdisasm is None:
        return None
    sass = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return collections.Counter(re.findall(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", sass))


def check_hopper_sass(ptx: str, tmp_path, mma: str = "QGMMA"):
    """After `ptxas_report` wrote tmp_path / k.cubin: every PTX wgmma is one SASS ``mma``
    (QGMMA for FP8, HGMMA for 16-bit), every packed e4m3 conversion one F2FP, and nothing
    touches local memory. Returns the opcode counts (None without nvdisasm)."""
    ops = sass_opcodes(tmp_path / "k.cubin")
    if ops is None:
        return None
    n_mma = sum(c for op, c in ops.items() if op.split(".")[0] == mma)
    other = "HGMMA" if mma == "QGMMA" else "QGMMA"
    assert n_mma == ptx.count("wgmma.mma_async.sync"), (n_mma, ptx.count("wgmma.mma_async"))
    assert not any(op.split(".")[0] == other for op in ops), ops
    n_cvt = sum(c for op, c in ops.items() if op.startswith("F2FP.SATFINITE.E4M3"))
    assert n_cvt == ptx.count("cvt.rn.satfinite.e4m3x2.f32"), n_cvt
    assert not any(op.split(".")[0] in ("LDL", "STL") for op in ops), ops
    return ops
