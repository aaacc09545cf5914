"""The FP8 forward kernel (`FlashFwdSm90Fp8`) without a GPU: every head dim dense and causal plus
each mask feature compiles for sm_90a with FP8 wgmma (e4m3 x e4m3, k 32) for both GEMMs, packed
e4m3 conversions of P, the in-shared-memory V transpose (PRMT byte shuffles, 32-bit shared
accesses) and no local memory (ptxas: no spills, no serialized wgmma); an FP8 call through
``implementation="cute"`` lowers to one custom call with no T x S tensor and survives a
jax.export round trip; block scales and unsupported FP8 calls are refused with the reason.

Each compile takes 5-10 s on 2 cores (+ about 1 s of ptxas).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from jaxflash.kernels.variants.fwd_fp8 import Fp8FwdConfig  # noqa: E402

pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
pytestmark = pytest.mark.compile

MATRIX = [
    Fp8FwdConfig(head_dim=64),
    Fp8FwdConfig(head_dim=64, is_causal=True, mask_select=True),
    Fp8FwdConfig(head_dim=128),
    Fp8FwdConfig(head_dim=128, is_causal=True, mask_select=True),
    Fp8FwdConfig(head_dim=256),
    Fp8FwdConfig(head_dim=256, is_causal=True, mask_select=True),
    Fp8FwdConfig(head_dim=128, has_window=True, has_softcap=True, has_q_seqlen=True,
                 has_kv_seqlen=True),
    Fp8FwdConfig(head_dim=128, is_causal=True, has_segments=True, out_dtype="float16"),
    # O staged over both V buffers (smaller key tiles): the consumers meet first
    Fp8FwdConfig(head_dim=256, tile_n=96),
    # the contract's 128-row block scales for q, k and v
    Fp8FwdConfig(head_dim=128, is_causal=True, mask_select=True, q_blocks=True, k_blocks=True,
                 v_blocks=True),
    Fp8FwdConfig(head_dim=256, q_blocks=True, k_blocks=True, v_blocks=True),
    # the persistent tile loop (O in its own buffer), with block scales
    Fp8FwdConfig(head_dim=128, persistent=True, is_causal=True, mask_select=True,
                 q_blocks=True, k_blocks=True, v_blocks=True),
    # three consumer warpgroups (192 rows) at hd 64: O over both V buffers
    Fp8FwdConfig(head_dim=64, tile_m=192, is_causal=True),
    # FlashAttention-3's wider FP8 key tile at hd 128 (benchmarks/fp8_bench.py --tiles)
    Fp8FwdConfig(head_dim=128, tile_n=224, is_causal=True, mask_select=True),
    # V^T from the XLA side: TMA straight into the V^T stages, no transpose in the kernel
    Fp8FwdConfig(head_dim=128, v_transposed=True),
    Fp8FwdConfig(head_dim=256, is_causal=True, mask_select=True, q_blocks=True, k_blocks=True,
                 v_blocks=True, v_transposed=True),
    Fp8FwdConfig(head_dim=64, has_window=True, has_softcap=True, has_kv_seqlen=True,
                 v_transposed=True),
    # hd 64's pick with per-tensor / per-head q scales (gated until its GPU check)
    Fp8FwdConfig(head_dim=64, tile_m=192, is_causal=True, v_transposed=True),
]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_fp8_variant_compiles_with_e4m3_wgmma_and_no_spills(cfg, tmp_path):
    from devtools.ptx_digest import ptx_of
    from jaxflash.kernels.variants.fwd_fp8_launch import fwd_fp8_launch
    from tests.common import check_hopper_sass, ptxas_report
    ptx = ptx_of(fwd_fp8_launch(cfg), str(tmp_path))
    assert ".target sm_90a" in ptx
    for n in (cfg.tile_n, cfg.head_dim_v):  # S = Q K^T, O += P V^T
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # P to e4m3, two at a time
    if cfg.v_transposed:  # nothing transposed in the kernel
        assert "prmt.b32" not in ptx and "st.shared.b32" not in ptx
    else:
        assert "prmt.b32" in ptx  # V's byte transpose
        assert "ld.shared.b32" in ptx and "st.shared.b32" in ptx
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx and "ex2.approx" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    rep = ptxas_report(ptx, tmp_path)
    if rep is None:
        pytest.skip("no usable ptxas here")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", rep)]
    assert spills and max(spills) == 0, rep
    assert "C7512" not in rep and "serialized" not in rep, rep
    # SASS: each FP8 wgmma one QGMMA (none fell back to 16-bit), each P conversion one F2FP
    ops = check_hopper_sass(ptx, tmp_path, "QGMMA")
    if ops is not None and cfg == Fp8FwdConfig(head_dim=128, v_transposed=True):
        # the block budget docs/design.md reasons from (`devtools.sass_loops`): a 128-key
        # block is 8 QGMMA, 64 exponentials + 2 rescale factors, 32 packed conversions a warp
        from devtools import sass_loops
        instrs, labels = sass_loops.instructions(str(tmp_path / "k.cubin"))
        first, last = max(sass_loops.loops(instrs, labels), key=lambda fl: fl[1] - fl[0])
        mix = collections.Counter(sass_loops.opcode(t) for _, t, _ in instrs[first:last + 1])
        assert (mix["QGMMA"], mix["MUFU"], mix["F2FP"]) == (8, 66, 32), mix


def _fp8_args(B=2, T=200, S=300, N=4, K=2, H=128, gran="head"):
    import jax
    import jax.numpy as jnp
    e4 = jnp.float8_e4m3fn
    sds = jax.ShapeDtypeStruct
    sc = (lambda h: sds((), jnp.float32)) if gran == "tensor" else (
        lambda h: sds((B, h), jnp.float32))
    return (sds((B, T, N, H), e4), sds((B, S, K, H), e4), sds((B, S, K, H), e4), sc(N), sc(K),
            sc(K))


def _attn(**kw):
    import jaxflash
    return lambda q, k, v, qs, ks, vs: jaxflash.flash_attention(
        q, k, v, q_scale=qs, k_scale=ks, v_scale=vs, implementation="cute", **kw)


@pytest.fixture
def cuda_env(tmp_path, monkeypatch):
    from jaxflash.ffi import cache
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("JAXFLASH_CUTE_UNVERIFIED", "1")
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_NO_DSL, raising=False)


def test_fp8_call_lowers_to_one_custom_call_and_exports(cuda_env):
    import jax

    import jaxflash
    from jaxflash import ffi
    B, T, S = 2, 200, 300
    args = _fp8_args(B, T, S)
    with jaxflash.target_platform("cuda"):
        low = jax.jit(_attn(is_causal=True)).trace(*args).lower(lowering_platforms=("cuda",))
    txt = low.as_text()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert f"tensor<{B}x{T}x4x128xf8E4M3FN>" in txt and f"tensor<{B}x{T}x4x128xbf16>" in txt
    # nothing T x S in the program (the emulation's tiles would be T x 128)
    assert not re.search(rf"tensor<[^>]*\b{T}x{S}\b", txt)
    assert not re.search(rf"tensor<[^>]*\b{T}x128x", txt.replace(f"{T}x4x128", ""))
    with jaxflash.target_platform("cuda"):
        exp = jax.export.export(jax.jit(_attn(is_causal=True)), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(*args)
    back = jax.export.deserialize(exp.serialize())
    assert ffi.TARGET in back.mlir_module()
    assert back.out_avals[0].shape == (B, T, 4, 128)


def test_fp8_plan_serves_128_row_blocks_and_refuses_others(monkeypatch):
    import jax.numpy as jnp

    import jaxflash
    # Cleared by its H200 checks: dispatched without the switch.
    monkeypatch.delenv("JAXFLASH_CUTE_UNVERIFIED", raising=False)
    args = _fp8_args()
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(*args[:3], q_scale=args[3], k_scale=args[4], v_scale=args[5])
    assert d.backend == "cute", str(d)
    assert "FlashFwdSm90Fp8" in str(d) and "backward: CuTe FP8 kernel FlashBwdSm90Fp8" in str(d)
    import jax
    sds = jax.ShapeDtypeStruct
    # the contract's 128-row blocks over 200 query / 300 key rows: the kernel's tiles
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(*args[:3], q_scale=sds((2, 4, 2), jnp.float32),
                             k_scale=sds((2, 2, 3), jnp.float32),
                             v_scale=sds((2, 2, 3), jnp.float32))
    assert d.backend == "cute" and "_sbqkv" in str(d), str(d)
    # 64-row blocks: not the kernel's tiles, refused with the reason (the emulation runs)
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(*args[:3], q_scale=sds((2, 4, 4), jnp.float32),
                             k_scale=sds((2, 2, 5), jnp.float32),
                             v_scale=sds((2, 2, 5), jnp.float32), scale_block=64)
    assert d.backend != "cute"
    assert "per 128 rows or per (batch, head) only" in dict(d.refused)["cute"], str(d)
    # float32 output (precision="fp8" on float32 inputs): refused, said so
    f32 = sds((2, 200, 4, 128), jnp.float32)
    with jaxflash.target_platform("cuda"):
        d = jaxflash.explain(f32, f32, f32, precision="fp8")
    assert "bfloat16 / float16 output" in dict(d.refused)["cute"], str(d)


def test_kernel_constants_follow_the_contract():
    """The kernel cannot import `jaxflash.fp8` (sibling layers): its P scale and key tile are
    checked against the contract here."""
    from jaxflash.fp8 import contract
    from jaxflash.kernels.sm90.fwd_fp8 import P_SHIFT_LOG2
    assert P_SHIFT_LOG2 == contract.P_SCALE_LOG2
    for c in MATRIX[:6]:  # the default tiles dispatch picks
        assert c.tile_n == contract.FWD_KV_TILE and c.tile_m % 128 == 0


def test_pre_transposed_v_is_in_the_order_p_is_packed():
    """`fp8_v_layout` puts key 16c + 2q + KEY_OFFSETS[i] at position 16c + 4q + i (the order
    the in-kernel transpose writes and P's registers pack), zero-pads the keys to a multiple
    of 16, and moves the keys last (contiguous)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.kernels.sm90.v_transpose import KEY_OFFSETS
    from jaxflash.kernels.variants.fwd_fp8_launch import fp8_v_layout
    B, S, K, Hv = 2, 37, 3, 8
    key = np.broadcast_to(np.arange(S)[None, :, None, None], (B, S, K, Hv)).astype(np.float32)
    vt = np.asarray(fp8_v_layout(jnp.asarray(key + 1)))   # +1: padding shows as 0
    assert vt.shape == (B, K, Hv, 48)
    for p in range(48):
        c, q, i = p // 16, (p % 16) // 4, p % 4
        want = 16 * c + 2 * q + KEY_OFFSETS[i]
        got = vt[:, :, :, p]
        assert (got == (want + 1 if want < S else 0)).all(), (p, want, got.ravel()[:4])


def test_pre_transposed_v_is_dispatched(monkeypatch):
    """V^T from the XLA side is the FP8 forward dispatch picks (cleared on the H200 by
    tests/kernels/test_fp8_gpu.py), without the switch."""
    from jaxflash._types import AttentionStatics, Fp8Spec, Problem
    from jaxflash.kernels.policy.choose import fp8_forward_config
    from jaxflash.kernels.policy.verified import pending
    spec = Fp8Spec(q_block=512, k_block=512, v_block=512, granularity=("tensor",) * 3)
    p = Problem(batch=2, q_len=512, kv_len=512, num_heads=4, num_kv_heads=4, head_dim=128,
                head_dim_v=128, dtype="float8_e4m3fn",
                statics=AttentionStatics(scale=0.1, fp8=spec), platform="cuda")
    monkeypatch.delenv("JAXFLASH_CUTE_UNVERIFIED", raising=False)
    cfg = fp8_forward_config(p)
    assert cfg.v_transposed and not pending(cfg)
    # hd 64 with per-tensor q scales: 192-row tiles (cleared on the H200, no switch needed);
    # q scales per 128-row block keep 128-row tiles
    p64 = dataclasses.replace(p, head_dim=64, head_dim_v=64)
    assert fp8_forward_config(p64).tile_m == 192 and not pending(fp8_forward_config(p64))
    # the measured schedules: persistent for causal calls up to 1k keys (hd 64 / 128), the
    # conditional rescale at hd 64 from 4k keys unless v has block scales
    def at(prob, L, causal=False):
        sp = Fp8Spec(q_block=L, k_block=L, v_block=L, granularity=("tensor",) * 3)
        return dataclasses.replace(prob, q_len=L, kv_len=L, statics=AttentionStatics(
            scale=0.1, fp8=sp, is_causal=causal))

    assert fp8_forward_config(at(p, 512, causal=True)).persistent
    assert not fp8_forward_config(at(p, 2048, causal=True)).persistent
    assert not fp8_forward_config(p).persistent
    long64 = at(p64, 4096)
    assert fp8_forward_config(long64).lazy_rescale
    assert not fp8_forward_config(p64).lazy_rescale
    blocks = Fp8Spec(q_block=128, k_block=128, v_block=128, granularity=("block",) * 3)
    pb = dataclasses.replace(p64, statics=AttentionStatics(scale=0.1, fp8=blocks))
    assert not fp8_forward_config(dataclasses.replace(pb, q_len=4096, kv_len=4096)).lazy_rescale
    assert fp8_forward_config(pb).tile_m == 128
