"""The FP4 Direct-P forward (`FlashFwdFp4Sm100`) compiles for sm_100a without a GPU, and its
PTX / SASS hold what the design says:

- QK^T by ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` (NVFP4, E4M3 scales per 16;
  head_dim / 64 K64 steps per tile) and PV by ``...block32`` (MXFP4, E8M0 per 32; two K64
  halves per 128-key tile) whose A operand (P) is a tensor-memory address;
- the P path: exactly one packed FMA (``fma.rn.f32x2``) and one relu-folded E2M1 convert
  (``cvt.rn.satfinite.relu.e2m1x2.f32``) per score pair, native EX2 only on the accurate
  policy's pairs, the denominator by byte permutes and one DP4A per N32 block;
- the scale pages (and the Q / K / V scales) copied into tensor memory by ``tcgen05.cp``;
- no stack, no spills; the scale-chunk byte order of `variants.sm100_fwd_fp4` equals the DSL's
  scale-factor layouts.

Each compile takes about 2-3 s on 2 cores. Nothing here has run on a Blackwell GPU.
"""
from __future__ import annotations

import glob
import re
import subprocess
import time

import pytest

from jaxflash.kernels.variants.sm100_fwd import REGS
from jaxflash.kernels.variants.sm100_fwd_fp4 import Sm100FwdFp4Config, scale_atom_offset

pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
pytestmark = pytest.mark.compile

MATRIX = [
    Sm100FwdFp4Config(policy="fast"),
    Sm100FwdFp4Config(policy="accurate"),
    Sm100FwdFp4Config(policy="fast", guard_shift=16),
    Sm100FwdFp4Config(policy="fast", head_dim=64),
]
SITES = 2          # the softmax step and the MMAs are emitted twice: the loop and the last tile
PAIRS = 64         # score pairs per row and 128-key tile
COMPILE_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from devtools.sm100_fp4_compile import compile_fwd_fp4
    out = {}

    def get(cfg):
        if cfg.key not in out:
            d = tmp_path_factory.mktemp(cfg.key)
            t0 = time.time()
            compile_fwd_fp4(cfg, num_heads=8, num_kv_heads=2, dump_dir=str(d))
            dt = time.time() - t0
            ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
            cubins = glob.glob(str(d / "*.cubin"))
            out[cfg.key] = (ptx, cubins[0] if cubins else None, dt)
        return out[cfg.key]
    return get


def _native_pairs(cfg):
    return 4 * sum(cfg.native_pair(p) for p in range(16))   # four N32 blocks per tile


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_compiles_with_the_block_scaled_fp4_instructions(cfg, compiled):
    ptx, _, seconds = compiled(cfg)
    assert ".target sm_100a" in ptx
    qk = [l for l in ptx.splitlines()
          if "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16" in l]
    pv = [l for l in ptx.splitlines()
          if "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32" in l]
    assert len(qk) == SITES * cfg.head_dim // 64, qk
    assert len(pv) == SITES * 2, pv
    assert "kind::f16" not in ptx and "kind::f8f6f4" not in ptx and "cta_group::2" not in ptx
    # operands: d (TMEM), a, b, idesc, scale A (TMEM), scale B (TMEM); PV's a is a TMEM
    # address in brackets, QK's a is a shared-memory descriptor
    tmem_a = re.compile(r"block(16|32)[.:\w]*\s+\[[^\]]+\],\s*\[[^\]]+\],")
    assert all(tmem_a.search(l) for l in pv), pv[:1]
    assert not any(tmem_a.search(l) for l in qk), qk[:1]
    assert all(re.search(r"\[[^\]]+\],\s*\[[^\]]+\],\s*%p\d+;", l) for l in qk + pv)
    # the P path per score pair: one packed FMA, one relu E2M1 convert
    cvt = re.findall(r"cvt\.rn\.satfinite\.relu\.e2m1x2\.f32", ptx)
    fma2 = re.findall(r"fma\.rn(\.ftz)?\.f32x2", ptx)
    assert len(cvt) == SITES * PAIRS and len(fma2) == SITES * PAIRS, (len(cvt), len(fma2))
    assert len(re.findall(r"ex2\.approx", ptx)) == SITES * 2 * _native_pairs(cfg)
    # the denominator from the codes: 8 byte permutes and one DP4A per N32 block
    assert len(re.findall(r"dp4a\.u32\.u32", ptx)) == SITES * 4
    assert len(re.findall(r"prmt\.b32", ptx)) >= SITES * 4 * 8
    # scales: Q once, K / V / the two halves' P pages per tile, by tcgen05.cp (32x128b, warpx4)
    assert len(re.findall(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", ptx)) >= 1 + 4 * SITES
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # the page, before the MMA warp copies it
    # P's codes: one 8-column store per K64 half, each half published on its own barrier
    assert len(re.findall(r"tcgen05\.st\.sync\.aligned\.32x32b\.x8\.", ptx)) == SITES * 2
    for instr in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.commit", "tcgen05.wait::ld", "tcgen05.wait::st",
                  "cp.async.bulk.tensor"):
        assert instr in ptx, instr
    softmax, correction, other = REGS
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{softmax};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{correction};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{other};", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert seconds < COMPILE_LIMIT_S, f"{cfg.key} took {seconds:.0f} s"


@pytest.mark.parametrize("cfg", MATRIX[:2], ids=lambda c: c.key)
def test_no_stack_no_spills(cfg, compiled, tmp_path):
    from tests.common import ptxas_report
    ptx, _, _ = compiled(cfg)
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    stack = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert spills and max(spills) == 0 and max(stack) == 0, report


@pytest.mark.parametrize("cfg", MATRIX[:2], ids=lambda c: c.key)
def test_sass_p_path_budget(cfg, compiled):
    """SASS: UTCOMMA.4X for QK (block16), UTCOMMA for PV (block32), per score pair one FFMA2
    and one F2FP.SATFINITE.RELU.E2M1, MUFU.EX2 only for the accurate policy's native pairs,
    IDP.4A per N32 block, UTCCP for the scales; no stack / local memory."""
    from tests.common import cuda_tool, sass_opcodes
    nvdisasm, cuobjdump = cuda_tool("nvdisasm"), cuda_tool("cuobjdump")
    if nvdisasm is None or cuobjdump is None:
        pytest.skip("nvdisasm / cuobjdump not installed (pip nvidia-cuda-nvdisasm "
                    "nvidia-cuda-cuobjdump)")
    ptx, cubin, _ = compiled(cfg)
    ops = sass_opcodes(cubin)
    assert ops["UTCOMMA.4X"] == SITES * cfg.head_dim // 64, ops
    assert ops["UTCOMMA"] == SITES * 2, ops
    e2m1 = sum(v for k, v in ops.items() if k.startswith("F2FP.SATFINITE.RELU.E2M1"))
    assert e2m1 == SITES * PAIRS and ops["FFMA2"] == SITES * PAIRS, (e2m1, ops["FFMA2"])
    assert ops["MUFU.EX2"] == SITES * 2 * _native_pairs(cfg)
    assert sum(v for k, v in ops.items() if k.startswith("IDP.4A")) == SITES * 4
    assert sum(v for k, v in ops.items() if k.startswith("UTCCP")) >= 1 + 4 * SITES
    res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"STACK:0\b", res) and re.search(r"LOCAL:0\b", res), res


def test_scale_chunk_order_is_the_dsl_scale_factor_layout():
    """The byte order the XLA side writes the scale chunks in (`scale_atom_offset`) is the
    DSL's shared-memory scale-factor layout for the QK (block 16) and PV (block 32) MMAs, so
    the load warp copies chunks verbatim; and the tensor-memory scale sets take the plan's
    column counts."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as h
    import cutlass.utils.blockscaled_layout as bsl
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
    fp4, k_ = cutlass.Float4E2M1FN, OperandMajorMode.K
    got = {}

    @cute.jit
    def probe():
        for name, sf, vec, hd in (("qk", cutlass.Float8E4M3FN, 16, 128),
                                  ("pv", cutlass.Float8E8M0FNU, 32, 128)):
            src = tcgen05.OperandSource.SMEM if name == "qk" else tcgen05.OperandSource.TMEM
            mma = h.make_blockscaled_trivial_tiled_mma(fp4, fp4, k_, k_, sf, vec,
                                                       tcgen05.CtaGroup.ONE, (128, 128), src)
            lay = bsl.make_smem_layout_sfa(mma, (128, 128, hd), vec, 1)
            per_mma = 64 // vec
            for m in (0, 1, 31, 32, 63, 64, 100, 127):
                for b in cutlass.range_constexpr(hd // vec):
                    crd = ((((m % 32, m // 32), 0), (0, b % per_mma)), 0, b // per_mma, 0)
                    got[(name, m, b)] = cute.crd2idx(crd, lay)
            tl = bsl.make_tmem_layout_sfa(mma, (128, 128, hd), vec,
                                          cute.slice_(lay, (None, None, None, 0)))
            got[(name, "cols")] = cute.cosize(tl)
    probe()
    for key, idx in got.items():
        if key[1] != "cols":
            assert int(idx) == scale_atom_offset(key[1], key[2]), (key, idx)
    cfg = Sm100FwdFp4Config()
    qk_cols, v_cols = cfg.sf_cols()
    # TMEM addresses: lane << 16 | column, 4 bytes a column, 4 lane quarters replicated
    for name, cols in (("qk", qk_cols), ("pv", v_cols)):
        c = int(got[(name, "cols")])
        assert (c - 1) % (1 << 18) + 1 == 4 * cols, (name, c, cols)
