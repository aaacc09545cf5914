"""``implementation="cute"`` end to end without a GPU: the backend's refusals (platform, arch,
kernel's can_implement, runtime-only without artifact) and the Hopper forward lowered for CUDA
through the bridge (custom call in the HLO, no recompile for new batch/lengths/scale, vmap,
jax.export). Numerics run on the GPU machine (the kernel's own tests)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cutlass", reason="needs the CuTe DSL compiler")
pytest.importorskip("jaxflash.kernels.sm90.fwd", reason="Hopper forward kernel not present")
pytestmark = pytest.mark.compile

import jaxflash  # noqa: E402
from jaxflash import ffi  # noqa: E402
from jaxflash.ffi import cache, compiler  # noqa: E402
from tests.common import runtime_only  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jf_cache"))  # one compile per variant for the module


@pytest.fixture(autouse=True)
def env(cache_dir, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, cache_dir)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)
    jax.clear_caches()
    yield


def _qkv(B=2, T=128, S=128, N=4, K=4, H=64, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, S, K, H), dtype),
            jax.ShapeDtypeStruct((B, S, K, H), dtype))


def _why(**kw):
    q, k, v = kw.pop("qkv", None) or _qkv()
    with jaxflash.target_platform(kw.pop("platform", "cuda")):
        d = jaxflash.explain(q, k, v, implementation="cute", **kw)
    return d.backend, dict(d.refused).get("cute", "")


def _lower(f, *args):
    with jaxflash.target_platform("cuda"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _attn(**kw):
    return lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="cute", **kw)


def test_served_on_cuda_sm90():
    assert _why(is_causal=True) == ("cute", "")


def test_refusals_name_the_reason(monkeypatch):
    assert "CUDA only" in _why(platform="cpu")[1]
    b = jax.ShapeDtypeStruct((1, 4, 128, 128), jnp.float32)
    assert "bias" in _why(bias=b)[1]  # the kernel's can_implement
    assert "head dim" in _why(qkv=_qkv(H=80))[1]
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    assert "no CuTe forward kernel for sm_120a" in _why()[1]
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")  # compiled, gated until a Blackwell run
    assert "gated until a Blackwell run" in _why()[1]


def test_runtime_only_refuses_without_artifact_and_serves_with_one(tmp_path, monkeypatch):
    from jaxflash import aot
    from jaxflash.kernels.plan import forward_launch as fwd_launch_for
    from jaxflash._types import AttentionStatics, Problem
    runtime_only(monkeypatch, tmp_path)
    backend, why = _why(is_causal=True)
    assert backend is None
    assert "not installed" in why and "python -m jaxflash.aot --arch sm_90a" in why
    monkeypatch.undo()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    problem = Problem(2, 128, 128, 4, 4, 64, 64, "bfloat16",
                      AttentionStatics(scale=0.125, is_causal=True), platform="cuda")
    aot.build([fwd_launch_for(problem, "sm_90a")], str(tmp_path), progress=False,
              log=lambda *_: None)
    runtime_only(monkeypatch, tmp_path)
    assert _why(is_causal=True) == ("cute", "")


def test_forward_lowers_once_for_many_shapes_and_scales(monkeypatch):
    calls = []
    real = compiler.compile_launch
    monkeypatch.setattr(compiler, "compile_launch", lambda l: calls.append(l) or real(l))
    cache.clear_memory_cache()
    seen = []
    for (B, T, S, N, K), scale in [((2, 128, 128, 4, 4), None), ((1, 77, 300, 8, 2), 0.3),
                                   ((3, 1, 5, 2, 1), 1.7)]:
        low = _lower(_attn(is_causal=True, scale=scale), *_qkv(B, T, S, N, K))
        txt = low.as_text()
        assert f"custom_call @{ffi.TARGET}" in txt
        assert f"tensor<{B}x{T}x{N}x64xbf16>" in txt and f"tensor<{B}x{N}x{T}xf32>" in txt
        seen.append(txt)
    # GQA ratio, batch, lengths and scale are runtime values: at most one compile in all
    # (zero if an earlier test of this module already built the variant).
    assert len(calls) <= 1


def test_vmap_and_export():
    q, k, v = (jax.ShapeDtypeStruct((3,) + s.shape, s.dtype) for s in _qkv())
    txt = _lower(jax.vmap(_attn(is_causal=True)), q, k, v).as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert "tensor<6x128x4x64xbf16>" in txt  # vmap (3) x batch (2) folded into the kernel's B
    with jaxflash.target_platform("cuda"):
        exp = jax.export.export(jax.jit(_attn(is_causal=True)), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(*_qkv())
    back = jax.export.deserialize(exp.serialize())
    assert ffi.TARGET in back.mlir_module()
    assert back.out_avals[0].shape == (2, 128, 4, 64)


def _alibi_seg_args(B=2, T=200, S=300, N=4, K=2):
    return _qkv(B, T, S, N, K) + (jax.ShapeDtypeStruct((N,), jnp.float32),
                                  jax.ShapeDtypeStruct((B, T), jnp.int32),
                                  jax.ShapeDtypeStruct((B, S), jnp.int32))


def _attn_alibi_seg(q, k, v, al, qs, ks):
    return jaxflash.flash_attention(q, k, v, implementation="cute", is_causal=True,
                                    alibi_slopes=al, q_segment_ids=qs, kv_segment_ids=ks)


def test_alibi_and_segments_are_served_and_lower_into_one_custom_call():
    q, k, v, al, qs, ks = _alibi_seg_args()
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(q, k, v, implementation="cute", is_causal=True, alibi_slopes=al,
                             q_segment_ids=qs, kv_segment_ids=ks)
    assert d.backend == "cute", str(d)
    txt = _lower(_attn_alibi_seg, q, k, v, al, qs, ks).as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert "tensor<1x4xf32>" in txt  # the slopes as [1, N]
    # segment ids and their block summaries: [B, ceil(T/128), 4] and [B, ceil(S/128), 2]
    for shape in ("2x200xi32", "2x300xi32", "2x2x4xi32", "2x3x2xi32"):
        assert f"tensor<{shape}>" in txt, shape


def test_alibi_and_segments_vmap_into_one_launch():
    """Under vmap the slopes ([1, N], dim 0 fixed) are shared, the segment tensors fold into
    the kernel's batch: still one launch."""
    q, k, v, al, qs, ks = _alibi_seg_args()
    up = lambda s: jax.ShapeDtypeStruct((3,) + s.shape, s.dtype)
    f = jax.vmap(_attn_alibi_seg, in_axes=(0, 0, 0, None, 0, 0))
    txt = _lower(f, up(q), up(k), up(v), al, up(qs), up(ks)).as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert "tensor<6x200x4x64xbf16>" in txt and "tensor<1x4xf32>" in txt
