"""First Blackwell run of the FP4 Direct-P kernel: `flash_attention(precision="fp4")` on a
compute capability 10.0 GPU (the switch set by the test: the kernel is gated until this passes)
against the JAX emulator (`jaxflash.fp4.direct_p`) and against exact attention. Anywhere else it
skips with the reason (the H200 refuses cleanly). It has never run: no Blackwell GPU was
available.

What it expects (from `test_fp4_sm100_operands.py`'s model of the kernel's arithmetic): output
within 5e-3 relative L2 of the emulator (codes differ only at E2M1 boundaries), the format's own
error against exact attention (cosine ~0.94, relative L2 ~0.34 on Gaussian inputs), V = ones
giving 1 per row, LSE within the emulator's, and finite rows for logits in the hundreds with
the guard. On a machine without the CuTe DSL build the variants first (``python -m jaxflash.aot
--arch sm_100a --out DIR --kernel sm100_fwd_fp4 policy=fast,accurate head_dim=64,128`` and
``JAXFLASH_KERNEL_DIR=DIR``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fp4.direct_p import direct_p_attention
from jaxflash.kernels.policy import verified

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devs) and str(getattr(devs[0], "compute_capability", "")) == "10.0"


@pytest.fixture(autouse=True)
def _only_blackwell(monkeypatch):
    if not _blackwell():
        pytest.skip("needs a compute capability 10.0 GPU (B200 / GB200): sm_100a kernels")
    monkeypatch.setenv(verified.ENV, "1")


def _qkv(B, T, S, N, K, H, seed=0, scale_q=1.0, ones_v=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)) * scale_q, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    v = (jnp.ones((B, S, K, H), jnp.bfloat16) if ones_v
         else jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16))
    return q, k, v


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("shape", [(1, 1024, 1024, 4, 4, 128), (2, 333, 1000, 8, 2, 128),
                                   (1, 257, 300, 4, 1, 64)], ids=str)
def test_kernel_matches_the_emulator(shape):
    q, k, v = _qkv(*shape)
    plan = jaxflash.explain(q, k, v, precision="fp4")
    assert plan.backend and "sm_100a kernel" in plan.backend, str(plan)
    out, lse = jaxflash.flash_attention(q, k, v, precision="fp4", return_residual=True)
    emu, emu_lse = direct_p_attention(q, k, v, return_lse=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out.astype(jnp.float32), emu.astype(jnp.float32)) < 5e-3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(emu_lse), atol=1e-3, rtol=1e-4)
    exact = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                         v.astype(jnp.float32))
    assert 0.30 < _rel(out.astype(jnp.float32), exact) < 0.40


def test_ones_value_rows_sum_to_one():
    q, k, v = _qkv(1, 256, 700, 2, 2, 128, ones_v=True)
    out = jaxflash.flash_attention(q, k, v, precision="fp4")
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, atol=4e-3)   # bf16 out


def test_guarded_kernel_keeps_extreme_logits_finite():
    from jaxflash.kernels import fp4_call
    q, k, v = _qkv(1, 256, 1024, 2, 2, 128, scale_q=40.0)      # logits in the hundreds
    ok, why, cfg = fp4_call.kernel_route(q, k, v, guard=True)
    assert ok, why
    out = fp4_call.forward(cfg, q, k, v, guard=True)
    emu = direct_p_attention(q, k, v, guard=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out.astype(jnp.float32), emu.astype(jnp.float32)) < 5e-3
