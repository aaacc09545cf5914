"""The 2-CTA Blackwell forward (`FlashFwdSm100Pair`, ``Sm100FwdConfig(two_cta=True)``) without a
GPU: it compiles for sm_100a through the bridge's launcher with every MMA a
``tcgen05.mma.cta_group::2`` (M = 256 over a CTA pair; the expected count per key block), tensor
memory allocated / freed / committed with ``cta_group::2`` (commits multicast to both CTAs),
2-CTA TMA loads, the second CTA's arrivals on the leader's barriers at cluster scope, cluster
barriers, the `setmaxnreg` budgets; ptxas: no stack, no spills; SASS: UTCHMMA.2CTA only.
Which calls may take it is checked in the config; dispatch does not pick it (not measured).

Compile-time facts only: no Blackwell GPU has run it.
"""
from __future__ import annotations

import glob
import re

import pytest

from jaxflash.kernels.variants.sm100_fwd import REGS, Sm100FwdConfig

C = Sm100FwdConfig
MATRIX = [C(head_dim=128, two_cta=True),
          C(head_dim=256, two_cta=True, has_softcap=True, has_kv_seqlen=True, has_alibi=True),
          # 128-key tiles (each CTA holds 64 keys of K, 96 value columns of V: SW64 rows), 3
          # stages, S0 | S1 | O = 448 tensor-memory columns
          C(head_dim=192, two_cta=True)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")
    from devtools.sm100_compile import compile_launch_sm100
    from jaxflash.kernels.variants.fwd_launch import sm100_fwd_launch
    out = {}

    def get(cfg):
        if cfg.key not in out:
            d = tmp_path_factory.mktemp(cfg.key[:60])
            launch = sm100_fwd_launch(cfg)
            assert launch.kernel.endswith(":FlashFwdSm100Pair")
            compile_launch_sm100(launch, str(d))
            out[cfg.key] = (open(glob.glob(str(d / "*.ptx"))[0]).read(),
                            glob.glob(str(d / "*.cubin"))[0])
        return out[cfg.key]
    return get


@pytest.mark.compile
@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_pair_variant_issues_2cta_mmas(cfg, compiled, tmp_path):
    from tests.common import ptxas_report
    ptx, _ = compiled(cfg)
    mmas = re.findall(r"tcgen05\.mma\.cta_group::2\.kind::f16", ptx)
    # per key block: QK in head_dim / 16 MMAs, PV in tile_n / 16, from two issue sites each
    assert len(mmas) == 2 * (cfg.head_dim // 16 + cfg.tile_n // 16), len(mmas)
    assert "tcgen05.mma.cta_group::1" not in ptx
    for instr in ("tcgen05.alloc.cta_group::2", "tcgen05.dealloc.cta_group::2",
                  "tcgen05.relinquish_alloc_permit.cta_group::2",
                  "tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster"
                  ".multicast::cluster", "tcgen05.ld", "tcgen05.st",
                  "barrier.cluster.arrive", "barrier.cluster.wait"):
        assert instr in ptx, instr
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global\S*cta_group::2",
                     ptx)
    # the second CTA's "P written" / "O rescaled" reach the leader: mapa + cluster arrive
    assert "mapa" in ptx and "mbarrier.arrive.release.cluster.shared::cluster" in ptx
    softmax, correction, other = REGS
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{softmax};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{correction};", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{other};", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = ptxas_report(ptx, tmp_path, arch="sm_100a")
    if report is None:
        pytest.skip("no usable ptxas for sm_100a")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    stack = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    assert spills and max(spills) == 0 and max(stack) == 0, report


@pytest.mark.compile
@pytest.mark.parametrize("cfg", [MATRIX[0], MATRIX[2]], ids=lambda c: c.key)
def test_pair_sass_is_utchmma_2cta(cfg, compiled):
    import subprocess

    from tests.common import cuda_tool, sass_opcodes
    nvdisasm, cuobjdump = cuda_tool("nvdisasm"), cuda_tool("cuobjdump")
    if nvdisasm is None or cuobjdump is None:
        pytest.skip("nvdisasm / cuobjdump not installed")
    ptx, cubin = compiled(cfg)
    ops = sass_opcodes(cubin)
    mma = {k: v for k, v in ops.items() if re.match(r"UTC\w*MMA", k)}
    assert mma == {"UTCHMMA.2CTA": len(re.findall(r"tcgen05\.mma\.cta_group::2", ptx))}, mma
    res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"STACK:0\b", res) and re.search(r"REG:168\b", res), res


def test_two_cta_is_for_dense_calls_and_not_dispatched():
    for bad in (dict(is_causal=True), dict(has_window=True), dict(has_q_seqlen=True),
                dict(has_segments=True), dict(head_dim=64), dict(head_dim=96)):
        with pytest.raises(ValueError, match="two_cta"):
            C(two_cta=True, **{"head_dim": 128, **bad})
    assert C(head_dim=128, two_cta=True).key.endswith("_2cta")
    from jaxflash.kernels.variants.sm100_fwd_fp8 import Sm100Fp8FwdConfig
    with pytest.raises(ValueError, match="two_cta"):
        Sm100Fp8FwdConfig(two_cta=True)
    # dispatch's pick is the 1-CTA kernel until a Blackwell run measures the pair
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy import choose
    st = AttentionStatics(scale=0.1, is_causal=False, window=None, softcap=None,
                          deterministic=False)
    for hd in (128, 192):
        p = Problem(batch=2, q_len=4096, kv_len=4096, num_heads=16, num_kv_heads=16,
                    head_dim=hd, head_dim_v=hd, dtype="bfloat16", statics=st, platform="cuda")
        cfg = choose.sm100_forward_config(p)
        assert not cfg.two_cta and cfg.head_dim == hd
