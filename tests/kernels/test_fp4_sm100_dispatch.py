"""precision="fp4" and the sm_100a FP4 Direct-P kernel's gate, on the CPU with a compute
capability 10.x GPU pretended (`frontend.has_sm100` patched): without the switch the kernel is
refused as compiled-and-unverified and the call asks for ``emulate=True`` (explain says so);
with ``JAXFLASH_CUTE_UNVERIFIED=1`` explain picks the kernel and the call lowers to one custom
call (for sm_100a, compiled here) with no T x S tensor; causal calls and unsupported head dims
stay refused with their reason; ``emulate=True`` always runs the emulation.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.fp4 import frontend
from jaxflash.kernels import fp4_call
from jaxflash.kernels.policy import verified

B, T, S, N, K, H = 1, 192, 320, 2, 1, 128   # T, S unlike any head dim


@pytest.fixture
def blackwell(monkeypatch):
    monkeypatch.setattr(frontend, "has_sm100", lambda: True)
    monkeypatch.delenv(verified.ENV, raising=False)
    return monkeypatch


def _qkv(h=H):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
            for s in ((B, T, N, h), (B, S, K, h), (B, S, K, h)))


def test_gated_without_the_switch(blackwell):
    q, k, v = _qkv()
    ok, why, cfg = fp4_call.kernel_route(q, k, v)
    assert not ok and "gated until a Blackwell run" in why and verified.ENV in why
    assert cfg.key == "fwd_sm100_fp4_fast_h128_t128x128s4"
    with pytest.raises(NotImplementedError, match="emulate=True") as e:
        jaxflash.flash_attention(q, k, v, precision="fp4")
    assert verified.ENV in str(e.value)
    plan = jaxflash.explain(q, k, v, precision="fp4")
    assert plan.backend is None and "gated until a Blackwell run" in str(plan)
    out = jaxflash.flash_attention(q, k, v, precision="fp4", emulate=True)   # still runs
    assert out.shape == q.shape and "emulated" in str(
        jaxflash.explain(q, k, v, precision="fp4", emulate=True))


def test_refusals_name_their_reason(blackwell):
    blackwell.setenv(verified.ENV, "1")
    q, k, v = _qkv()
    ok, why, _ = fp4_call.kernel_route(q, k, v, is_causal=True)
    assert not ok and "causal" in why
    with pytest.raises(NotImplementedError, match="causal FP4 path"):
        jaxflash.flash_attention(q, k, v, precision="fp4", is_causal=True)
    q, k, v = _qkv(h=96)
    ok, why, _ = fp4_call.kernel_route(q, k, v)
    assert not ok and "head dim 96" in why


def test_admitted_with_the_switch_lowers_to_one_custom_call(blackwell, tmp_path):
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    from jaxflash import ffi
    from jaxflash.ffi import cache
    blackwell.setenv(verified.ENV, "1")
    blackwell.setenv("CUTE_DSL_ARCH", "sm_100a")
    blackwell.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    blackwell.delenv(cache.ENV_KERNEL_DIR, raising=False)
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, kv, kv, precision="fp4")
        assert plan.backend and "sm_100a kernel" in plan.backend, str(plan)
        assert "compiled and instruction-checked only" in str(plan)
        f = lambda q, k, v: jaxflash.flash_attention(q, k, v, precision="fp4")
        exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(q, kv, kv)
    txt = exp.mlir_module()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert f"{T}x{S}" not in txt and f"{S}x{T}" not in txt
    assert exp.out_avals[0].shape == (B, T, N, H)
