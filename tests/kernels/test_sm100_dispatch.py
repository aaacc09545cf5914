"""Dispatch of the sm_100a forward on CPU, with the device's compute capability faked:

- on 10.x the sm100 variants are gated like any unverified variant: `explain` says they are
  compiled and instruction-checked only, gated until a Blackwell run, and another backend serves;
- ``JAXFLASH_CUTE_UNVERIFIED=1`` admits them (the plan's forward is `FlashFwdSm100`, its
  backward `FlashBwdSm100` (at head dim 256 two passes of it); where that cannot serve, e.g.
  deterministic with segment ids, the Pallas kernels on the forward's (out, lse), and the plan
  says why);
- on Hopper (9.0) they are never chosen, and on other architectures there is no CuTe kernel.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash.ffi import variant
from jaxflash.kernels.policy import verified

pytestmark = pytest.mark.cpu


@dataclasses.dataclass
class _FakeGpu:
    compute_capability: str
    platform: str = "gpu"


@pytest.fixture
def gpu(monkeypatch):
    """Make the local device report a compute capability (no $CUTE_DSL_ARCH override)."""
    def fake(cc):
        monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu(cc)])
        variant._local_gpu_arch.cache_clear()
    yield fake
    variant._local_gpu_arch.cache_clear()


def _qkv(H=128, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((2, 256, 4, H), dtype),
            jax.ShapeDtypeStruct((2, 256, 2, H), dtype),
            jax.ShapeDtypeStruct((2, 256, 2, H), dtype))


def _explain(implementation=None, **kw):
    with jaxflash.target_platform("cuda"):
        return jaxflash.explain(*_qkv(kw.pop("H", 128)), implementation=implementation, **kw)


def test_fake_capability_maps_to_the_arch(gpu):
    gpu("10.0")
    assert variant.current_arch() == "sm_100a"
    gpu("9.0")
    assert variant.current_arch() == "sm_90a"


def test_blackwell_variants_are_gated_by_default(gpu, monkeypatch):
    monkeypatch.delenv(verified.ENV, raising=False)
    gpu("10.0")
    plan = _explain("cute", is_causal=True)
    why = dict(plan.refused).get("cute", "")
    assert plan.backend is None
    assert "compiled and instruction-checked only, gated until a Blackwell run" in why, why
    assert verified.ENV in why and "fwd_sm100_" in why
    # the default order goes on to another backend, never to the gated kernel
    plan = _explain(is_causal=True)
    assert plan.backend != "cute"
    assert "gated until a Blackwell run" in str(plan)


def test_switch_admits_the_blackwell_forward(gpu, monkeypatch):
    pytest.importorskip("cutlass", reason="planning without the DSL needs an artifact")
    monkeypatch.setenv(verified.ENV, "1")
    gpu("10.0")
    from jaxflash.kernels.variants.sm100_bwd import SUPPORTED_HEAD_DIMS as BWD_HEAD_DIMS
    for kw in (dict(is_causal=True), dict(local_window_size=(64, 0)), dict(softcap=20.0), dict(H=64),
               dict(H=256), dict(H=96, is_causal=True), dict(H=192, softcap=20.0)):
        h = kw.pop("H", 128)
        plan = _explain("cute", H=h, **kw)
        assert plan.backend == "cute", plan
        assert plan.detail.fwd.kernel.endswith(":FlashFwdSm100")
        assert plan.detail.fwd.arch == "sm_100a"
        assert plan.detail.fwd.config.head_dim == h
        if h not in BWD_HEAD_DIMS:  # e.g. 96 / 192: Pallas on the forward's (out, lse), and
            # the plan says why
            assert plan.detail.bwd is None
            assert f"head dim {h} not supported by the sm_100a backward" in plan.detail.bwd_reason
        else:
            assert plan.detail.bwd.kernel.endswith(":FlashBwdSm100"), plan.detail
            assert plan.detail.bwd.arch == "sm_100a"
            assert "FlashBwdSm100" in plan.detail.note
            # hd 256: dK + dV take all of tensor memory, so the backward is two passes
            assert plan.detail.bwd.config.bwd_pass == ("dv" if h == 256 else "all")
            assert ("in 2 passes" in plan.detail.note) == (h == 256), plan.detail.note


def test_blackwell_backward_is_gated_with_the_forward(gpu, monkeypatch):
    """Without the switch neither sm_100a kernel is planned; with it, the backward's variant
    follows the call (deterministic, ALiBi, segment ids, GQA as a runtime ratio) and what it
    cannot serve falls back visibly."""
    pytest.importorskip("cutlass", reason="planning without the DSL needs an artifact")
    from jaxflash.kernels.policy.verified import pending
    from jaxflash.kernels.variants.sm100_bwd import Sm100BwdConfig
    assert pending(Sm100BwdConfig()) == (verified.BLACKWELL_PENDING,)
    monkeypatch.setenv(verified.ENV, "1")
    gpu("10.0")
    plan = _explain("cute", is_causal=True, deterministic=True)
    assert plan.detail.bwd.config.deterministic and plan.detail.bwd.config.is_causal
    plan = _explain("cute", alibi_slopes=jnp.ones((4,), jnp.float32))
    assert plan.detail.bwd.config.has_alibi
    seg = jnp.zeros((2, 256), jnp.int32)
    plan = _explain("cute", q_segment_ids=seg, kv_segment_ids=seg)
    assert plan.detail.bwd.config.has_segments
    # what it cannot serve falls back visibly: Pallas on the forward's (out, lse), and why
    plan = _explain("cute", q_segment_ids=seg, kv_segment_ids=seg, deterministic=True)
    assert plan.detail.bwd is None
    assert "deterministic with segment ids" in plan.detail.bwd_reason
