"""The Blackwell FP8 forward (`FlashFwdSm100Fp8`) without a GPU: its variants compile for sm_100a
through the bridge's launcher with both MMAs ``tcgen05.mma ... kind::f8f6f4`` (the expected count
per key block, P read from tensor memory), packed e4m3 conversions of P, the tensor-memory and
TMA instructions, the warpgroups' `setmaxnreg` budgets; ptxas reports no stack and no spills;
the SASS has one UTCQMMA per PTX MMA. Its tensor-memory plan (8-bit P) is checked before
tracing, its constants follow the FP8 contract, and dispatch gates it on compute capability
10.0 (the switch admits it; Hopper keeps its own FP8 kernel).

Nothing here has run on a Blackwell GPU: compile-time facts only. About 5 s a compile.
"""
from __future__ import annotations

import glob
import re
import time

import pytest

from jaxflash.kernels.variants.sm100_fwd import REGS
from jaxflash.kernels.variants.sm100_fwd_fp8 import Sm100Fp8FwdConfig

C = Sm100Fp8FwdConfig
MATRIX = [
    C(head_dim=64),
    C(head_dim=128, is_causal=True, out_dtype="float16"),
    C(head_dim=256),
    # the contract's 128-row block scales with softcap and lengths
    C(head_dim=128, has_softcap=True, has_q_seqlen=True, has_kv_seqlen=True, q_blocks=True,
      k_blocks=True, v_blocks=True),
    C(head_dim=256, is_causal=True, q_blocks=True, k_blocks=True, v_blocks=True),
]
# Windows and segment ids once made ptxas spill here (8 and 72 B of stack): values live across
# the warp-role split, per-element segment-id loads beside the row of scores (`sm100.fwd_tile`).
WINDOW_SEGMENTS = [
    C(head_dim=128, has_window=True, is_causal=True),
    C(head_dim=128, is_causal=True, has_segments=True, k_blocks=True, v_blocks=True),
]
COMPILE_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{key: (ptx, cubin path, seconds)}, each variant compiled once for the module."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    from devtools.sm100_compile import compile_launch_sm100
    from jaxflash.kernels.variants.fwd_fp8_launch import sm100_fwd_fp8_launch
    out = {}

    def get(cfg):
        if cfg.key not in out:
            d = tmp_path_factory.mktemp(cfg.key[:60])
            t0 = time.time()
            compile_launch_sm100(sm100_fwd_fp8_launch(cfg), str(d))
            dt = time.time() - t0
            ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
            cubins = glob.glob(str(d / "*.cubin"))
            out[cfg.key] = (ptx, cubins[0] if cubins else None, dt)
        return out[cfg.key]
    return get


@pytest.mark.compile
@pytest.mark.parametrize("cfg", MATRIX + WINDOW_SEGMENTS, ids=lambda c: c.key)
def test_fp8_variant_compiles_with_f8f6f4_mmas(cfg, compiled):
    ptx, _, seconds = compiled(cfg)
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", ptx)
    # per key block: QK^T in head_dim / 32 MMAs (K = 32 for 8-bit), PV in tile_n / 32; each
    # issued from two places (the first block before the loop, the last PV after it)
    assert len(mmas) == 2 * (cfg.head_dim // 32 + cfg.tile_n // 32), len(mmas)
    assert "kind::f16" not in ptx and "cta_group::2" not in ptx
    # PV reads P from tensor memory: the A operand is a TMEM address in brackets
    pv = [l for l in ptx.splitlines()
          if re.search(r"kind::f8f6f4[.:\w]*\s+\[[^\]]+\],\s*\[", l)]
    assert len(pv) == 2 * (cfg.tile_n // 32), len(pv)
    # P to e4m3 two at a time: tile_n / 2 packed converts per softmax step, at each call site
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) >= cfg.tile_n // 2
    for instr in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st",
                  "tcgen05.commit", "tcgen05.wait::ld", "tcgen05.wait::st",
                  "cp.async.bulk.tensor", "ex2.approx"):
        assert instr in ptx, instr
    softmax, correction, other = REGS
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{softmax};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{correction};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{other};", ptx)
    if cfg.k_blocks:  # each block's scores times its k scale, two at a time
        assert "mul.rn.f32x2" in ptx or "mul.f32x2" in ptx
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert seconds < COMPILE_LIMIT_S, f"{cfg.key} took {seconds:.0f} s"


@pytest.mark.compile
@pytest.mark.parametrize("cfg", MATRIX + WINDOW_SEGMENTS, ids=lambda c: c.key)
def test_fp8_variant_has_no_stack_and_no_spills(cfg, compiled, tmp_path):
    from tests.common import ptxas_report
    ptx, _, _ = compiled(cfg)
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    stack = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert spills and max(spills) == 0 and max(stack) == 0, report


@pytest.mark.compile
def test_fp8_sass_and_resources(compiled):
    """SASS: one UTCQMMA (the f8f6f4 MMA) per PTX MMA and no 16-bit UTCHMMA; cuobjdump: no
    stack, no local memory, 168 registers at launch."""
    import subprocess

    from tests.common import cuda_tool, sass_opcodes
    nvdisasm, cuobjdump = cuda_tool("nvdisasm"), cuda_tool("cuobjdump")
    if nvdisasm is None or cuobjdump is None:
        pytest.skip("nvdisasm / cuobjdump not installed (pip nvidia-cuda-nvdisasm "
                    "nvidia-cuda-cuobjdump)")
    cfg = MATRIX[1]
    ptx, cubin, _ = compiled(cfg)
    ops = sass_opcodes(cubin)
    n_mma = len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", ptx))
    assert ops["UTCQMMA"] == n_mma and ops["UTCHMMA"] == 0, {k: v for k, v in ops.items()
                                                             if "MMA" in k}
    res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"STACK:0\b", res) and re.search(r"LOCAL:0\b", res), res
    assert re.search(r"REG:168\b", res), res


def test_fp8_tmem_plan_is_8bit_p_over_retired_s():
    """P in e4m3 is tile_n / 4 columns over the start of its own S buffer, stored after the
    whole row is read; at head dim 256 S0 | S1 | O fill the 512 columns exactly."""
    from jaxflash.kernels.variants import tmem_plan
    for hd in (64, 128, 256):
        plan = C(head_dim=hd).tmem_plan()
        assert plan.check() == (True, "")
        for i in (0, 1):
            p, s = plan.region(f"P{i}"), plan.region(f"S{i}")
            assert p.cols == 32 and p.start == s.start
        assert plan.region("O").end == 256 + hd <= tmem_plan.TMEM_COLUMNS
    # a P overlay that reaches O (or the other S buffer) fails the check before any tracing
    plan = C(head_dim=256).tmem_plan()
    bad = tmem_plan.TmemPlan(
        tuple(tmem_plan.Region("P1", "P", 250, 32, 1) if r.name == "P1" else r
              for r in plan.regions), plan.softmax_order)
    ok, why = bad.check()
    assert not ok and "P1" in why


def test_fp8_config_rules():
    from jaxflash.fp8 import contract
    from jaxflash.kernels.variants import sm100_fwd_fp8
    assert sm100_fwd_fp8.P_SHIFT_LOG2 == contract.P_SCALE_LOG2
    for c in MATRIX:
        assert c.tile_n == contract.FWD_KV_TILE and c.tile_m == 128
        assert c.rescale_threshold == 0.0
    for bad, why in ((dict(rescale_threshold=8.0), "row max is exact"),
                     (dict(tile_n=64), "128-key softmax tile"),
                     (dict(has_alibi=True), "no ALiBi"),
                     (dict(out_dtype="float32"), "out_dtype"),
                     (dict(dtype="float8_e5m2"), "dtype"),
                     (dict(head_dim=96), "head_dim 96")):
        with pytest.raises(ValueError, match=why):
            C(**bad)
    assert C(head_dim=128, q_blocks=True).key.startswith("fwd8_sm100_e4m3_obf16_h128")
    assert C(head_dim=128, q_blocks=True).key.endswith("_sbq")


# ---------------------------------------------------------------- dispatch (CPU, faked device)
@pytest.fixture
def gpu(monkeypatch):
    """Make the local device report a compute capability (no $CUTE_DSL_ARCH override)."""
    import dataclasses

    import jax

    from jaxflash.ffi import variant

    @dataclasses.dataclass
    class _FakeGpu:
        compute_capability: str
        platform: str = "gpu"

    def fake(cc):
        monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu(cc)])
        variant._local_gpu_arch.cache_clear()
    yield fake
    variant._local_gpu_arch.cache_clear()


def _explain_fp8(**kw):
    import jax
    import jax.numpy as jnp

    import jaxflash
    e4, sds = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    B, T, S, N, K, H = 2, 200, 300, 4, 2, 128
    q, k = sds((B, T, N, H), e4), sds((B, S, K, H), e4)
    with jaxflash.target_platform("cuda"):
        return jaxflash.explain(q, k, k, q_scale=sds((B, N), jnp.float32),
                                k_scale=sds((B, K), jnp.float32),
                                v_scale=sds((B, K), jnp.float32), **kw)


def test_fp8_on_blackwell_is_gated_then_admitted(gpu, monkeypatch):
    from jaxflash.kernels.policy import verified
    monkeypatch.delenv(verified.ENV, raising=False)
    gpu("10.0")
    d = _explain_fp8(is_causal=True)
    assert d.backend != "cute"
    why = dict(d.refused).get("cute", "")
    assert "gated until a Blackwell run" in why and "fwd8_sm100_e4m3" in why, str(d)
    pytest.importorskip("cutlass", reason="planning without the DSL needs an artifact")
    monkeypatch.setenv(verified.ENV, "1")
    d = _explain_fp8(is_causal=True)
    assert d.backend == "cute", str(d)
    assert d.detail.fwd.kernel.endswith(":FlashFwdSm100Fp8") and d.detail.fwd.arch == "sm_100a"
    assert "emulated FP8 backward" in str(d)
    gpu("9.0")  # Hopper keeps its own FP8 kernel
    d = _explain_fp8(is_causal=True)
    assert d.detail.fwd.kernel.endswith(":FlashFwdSm90Fp8"), str(d)


@pytest.mark.compile
def test_fp8_blackwell_call_lowers_and_exports(tmp_path, monkeypatch):
    """With the switch on and sm_100a targeted, an FP8 call lowers to one custom call holding
    the e4m3 operands, no T x S tensor, and survives a jax.export round trip."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import ffi
    from jaxflash.ffi import cache
    from jaxflash.kernels.policy import verified
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(cache.ENV_KERNEL_DIR, raising=False)
    e4, sds = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    B, T, S, N, K, H = 2, 200, 300, 4, 2, 128
    args = (sds((B, T, N, H), e4), sds((B, S, K, H), e4), sds((B, S, K, H), e4),
            sds((B, N), jnp.float32), sds((B, K), jnp.float32), sds((B, K), jnp.float32))
    f = lambda q, k, v, qs, ks, vs: jaxflash.flash_attention(
        q, k, v, q_scale=qs, k_scale=ks, v_scale=vs, implementation="cute", is_causal=True)
    with jaxflash.target_platform("cuda"):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(*args)
    txt = exp.mlir_module()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert f"tensor<{B}x{T}x{N}x{H}xf8E4M3FN>" in txt
    assert not re.search(rf"tensor<[^>]*\b{T}x{S}\b", txt)
    back = jax.export.deserialize(exp.serialize())
    assert ffi.TARGET in back.mlir_module() and back.out_avals[0].shape == (B, T, N, H)
