"""The Blackwell forward (`FlashFwdSm100`) compiles for sm_100a without a GPU, and its PTX holds
what the design says: tcgen05 MMAs (kind::f16) with S / P / O in tensor memory, the expected
number of MMAs per key block, tensor-memory alloc / ld / st / commit, TMA loads, the warpgroups'
`setmaxnreg` budgets, the polynomial exp2 beside MUFU; ptxas reports no stack and no spills; the
same source and options give the same cubin bytes.

Nothing here has run on a Blackwell GPU: these are compile-time facts only.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import time

import pytest

# (each compile targets sm_100a through jaxflash.ffi.compiler.target_arch; the process-wide
# CUTE_DSL_ARCH is left alone, since other tests in this worker plan for sm_90a)

from jaxflash.kernels.variants.sm100_fwd import REGS, Sm100FwdConfig  # noqa: E402

cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

# D 64 / 128 / 256 x dense / causal / window / softcap, bf16 and fp16; D 96 (SW64 operand tiles:
# 192-byte rows) and D 192 (64-key tiles, 3 stages) once each; every compile has 8 query heads
# on 2 K/V heads (GQA is a runtime ratio, one binary serves every ratio); plus lengths, ALiBi
# and segment ids once.
MATRIX = [
    Sm100FwdConfig(head_dim=64),
    Sm100FwdConfig(head_dim=64, is_causal=True, dtype="float16"),
    Sm100FwdConfig(head_dim=128),
    Sm100FwdConfig(head_dim=128, is_causal=True),
    Sm100FwdConfig(head_dim=128, has_window=True),
    Sm100FwdConfig(head_dim=128, has_softcap=True, dtype="float16"),
    Sm100FwdConfig(head_dim=256),
    Sm100FwdConfig(head_dim=256, is_causal=True, has_softcap=True),
    Sm100FwdConfig(head_dim=96, is_causal=True, dtype="float16"),
    Sm100FwdConfig(head_dim=192, has_window=True, has_softcap=True),
    Sm100FwdConfig(head_dim=128, is_causal=True, has_q_seqlen=True, has_kv_seqlen=True,
                   has_alibi=True, has_segments=True),
]
COMPILE_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile each variant once for the module: {key: (ptx text, cubin path, seconds)}."""
    from devtools.sm100_compile import compile_fwd_sm100
    out = {}

    def get(cfg):
        if cfg.key not in out:
            d = tmp_path_factory.mktemp(cfg.key[:60])
            t0 = time.time()
            compile_fwd_sm100(cfg, num_heads=8, num_kv_heads=2, dump_dir=str(d))
            dt = time.time() - t0
            ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
            cubins = glob.glob(str(d / "*.cubin"))
            out[cfg.key] = (ptx, cubins[0] if cubins else None, dt)
        return out[cfg.key]
    return get


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_compiles_with_the_blackwell_instructions(cfg, compiled):
    ptx, _, seconds = compiled(cfg)
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx)
    # per key block: QK^T in head_dim / 16 MMAs (K = 16 per instruction), PV in tile_n / 16;
    # each is issued from two places (the first block before the loop; the last PV after it)
    per_block = cfg.head_dim // 16 + cfg.tile_n // 16
    assert len(mmas) == 2 * per_block, (len(mmas), per_block)
    assert "cta_group::2" not in ptx
    for instr in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st",
                  "tcgen05.commit", "tcgen05.wait::ld", "tcgen05.wait::st",
                  "tcgen05.fence::before_thread_sync", "tcgen05.fence::after_thread_sync",
                  "cp.async.bulk.tensor"):
        assert instr in ptx, instr
    # the PV MMA reads P from tensor memory: its A operand is a TMEM address in brackets
    # (the QK MMA's are two shared-memory descriptors)
    lines = [l for l in ptx.splitlines() if "tcgen05.mma.cta_group::1.kind::f16" in l]
    a_tmem = [l for l in lines if re.search(r"kind::f16[.:\w]*\s+\[[^\]]+\],\s*\[", l)]
    assert len(a_tmem) == 2 * (cfg.tile_n // 16), (len(a_tmem), lines[:2])
    softmax, correction, other = REGS
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{softmax};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{correction};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{other};", ptx)
    # exp2: most pairs on MUFU, every ex2_poly_every-th on the FMA pipes (the round-down add
    # that splits off the integer part is the polynomial's signature)
    ex2 = len(re.findall(r"ex2\.approx", ptx))
    rm = len(re.findall(r"add\.rm(\.ftz)?\.f32x2", ptx))
    pairs = cfg.tile_n // 2
    poly_pairs = pairs // cfg.ex2_poly_every
    assert rm >= poly_pairs and ex2 >= 2 * (pairs - poly_pairs), (rm, ex2)
    # the polynomial's ops are the ones `exp2_poly.model_exp2` models: round-down add, then
    # round-to-nearest subtracts and fused multiply-adds, none flushing subnormals
    assert "fma.rn.f32x2" in ptx and "sub.rn.f32x2" in ptx
    assert not re.search(r"(add|sub|fma)\.r[mn]\.ftz\.f32x2", ptx)
    # ... with the model's constants (single-sourced in `exp2_poly`), as PTX float immediates
    import struct
    from jaxflash.kernels.variants import exp2_poly
    for c in (exp2_poly.C1, exp2_poly.C2, exp2_poly.C3, exp2_poly.ROUND_MAGIC,
              exp2_poly.CLAMP_LOW):
        bits = struct.unpack("<I", struct.pack("<f", c))[0]
        assert f"0f{bits:08X}" in ptx, (c, f"0f{bits:08X}")
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    assert seconds < COMPILE_LIMIT_S, f"{cfg.key} took {seconds:.0f} s"


@pytest.mark.parametrize("cfg", MATRIX[:1] + MATRIX[2:4] + MATRIX[6:7] + MATRIX[8:10],
                         ids=lambda c: c.key)
def test_no_stack_no_spills(cfg, compiled, tmp_path):
    from tests.common import ptxas_report
    ptx, _, _ = compiled(cfg)
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    stack = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert spills and max(spills) == 0 and max(stack) == 0, report


# Compiled as the bridge compiles them (head counts and lengths dynamic), these once spilled
# (16 and 144 B of stack): values computed before the warp-role split lived into the
# 104-register warps, and the per-element segment-id loads sat beside the row of scores. The
# static-head compiles above did not show it. About 8 s each. The D 192 one: every mask input
# beside the widest O row the correction warpgroup walks (6 chunks of 32 columns).
BRIDGE = [Sm100FwdConfig(head_dim=128, has_window=True), MATRIX[-1],
          Sm100FwdConfig(head_dim=192, is_causal=True, has_q_seqlen=True, has_kv_seqlen=True,
                         has_alibi=True, has_segments=True)]


@pytest.mark.parametrize("cfg", BRIDGE, ids=lambda c: c.key)
def test_no_stack_no_spills_through_the_bridge(cfg, tmp_path):
    from devtools.sm100_compile import compile_launch_sm100
    from jaxflash.ffi.variant import load_ref
    from jaxflash.kernels import KERNELS
    from tests.common import ptxas_report
    compile_launch_sm100(load_ref(KERNELS["sm100_fwd"].launch)(cfg), str(tmp_path))
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    assert ".target sm_100a" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    if cfg.has_segments:  # the key block's ids staged in shared memory, read back 4 at a time
        assert re.search(r"bar\.sync\s+1,\s*128;", ptx) and "ld.shared.v4.b32" in ptx
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    stack = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert spills and max(spills) == 0 and max(stack) == 0, report


def test_same_source_same_cubin(tmp_path):
    """Two fresh processes, the DSL's in-memory and file caches off, compile one variant: the
    cubins are byte-identical (what keying artifacts by source hash relies on)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digests = []
    for i in range(2):
        d = tmp_path / str(i)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_NO_CACHE="1",
                   CUTE_DSL_DISABLE_FILE_CACHING="1", DUMP=str(d))
        subprocess.run([sys.executable, "-m", "devtools.sm100_compile", "64"], cwd=root,
                       env=env, check=True, capture_output=True)
        cubin = glob.glob(str(d / "*.cubin"))
        assert cubin, "no cubin dumped"
        digests.append(hashlib.sha256(open(cubin[0], "rb").read()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.parametrize("cfg", [MATRIX[2], MATRIX[3], MATRIX[9]], ids=lambda c: c.key)
def test_sass_and_resources(cfg, compiled):
    """SASS (nvdisasm): one UTCHMMA per PTX MMA, MUFU.EX2 beside the polynomial's FADD2.RM /
    FFMA2, tensor-memory loads / stores (LDTM / STTM), TMA loads (UTMALDG); cuobjdump: no stack,
    no local memory, 168 registers at launch (384 threads)."""
    import subprocess

    from tests.common import cuda_tool, sass_opcodes
    nvdisasm, cuobjdump = cuda_tool("nvdisasm"), cuda_tool("cuobjdump")
    if nvdisasm is None or cuobjdump is None:
        pytest.skip("nvdisasm / cuobjdump not installed (pip nvidia-cuda-nvdisasm "
                    "nvidia-cuda-cuobjdump)")
    ptx, cubin, _ = compiled(cfg)
    ops = sass_opcodes(cubin)
    n_mma = len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx))
    assert ops["UTCHMMA"] == n_mma, {k: v for k, v in ops.items() if "MMA" in k}
    pairs = cfg.tile_n // 2
    poly = pairs // cfg.ex2_poly_every
    assert ops["FADD2.RM"] >= poly and ops["FFMA2"] >= 3 * poly + pairs
    assert ops["MUFU.EX2"] >= 2 * (pairs - poly)
    for op in ("LDTM", "STTM"):
        assert sum(v for k, v in ops.items() if k.startswith(op)) > 0, op
    assert any(k.startswith("UTMALDG") for k in ops)
    res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"STACK:0\b", res) and re.search(r"LOCAL:0\b", res), res
    assert re.search(r"REG:168\b", res), res


def test_lowers_and_exports_through_the_bridge(tmp_path, monkeypatch):
    """With the switch on and sm_100a targeted, `implementation="cute"` lowers the Blackwell
    forward through the XLA FFI bridge (the bridge's own argument order and layouts: GQA,
    lengths, window as runtime values), the module holds the custom call and no T x S tensor,
    and `jax.export` round-trips it."""
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
    B, T, S, N, K, H = 2, 640, 896, 8, 2, 128
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
    f = lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="cute",
                                                 is_causal=True, local_window_size=(256, 0))
    with jaxflash.target_platform("cuda"):
        plan = jaxflash.explain(q, kv, kv, implementation="cute", is_causal=True,
                                local_window_size=(256, 0))
        assert plan.detail.fwd.kernel.endswith(":FlashFwdSm100"), plan
        exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                                disabled_checks=ffi.export_safety_checks())(q, kv, kv)
    txt = exp.mlir_module()
    assert txt.count(f"custom_call @{ffi.TARGET}") == 1
    assert f"{T}x{S}" not in txt and f"{S}x{T}" not in txt  # no T x S tensor
    back = jax.export.deserialize(exp.serialize())
    assert ffi.TARGET in back.mlir_module()
    assert back.out_avals[0].shape == (B, T, N, H)
