"""The Hopper forward kernel compiles for sm_90a without a GPU, over a matrix that covers every
supported head dim, dtype and mask feature at least once; its PTX holds the wgmma / TMA / exp2
instructions the design relies on; unsupported variants are refused with a reason.

Each compile takes 2-7 s on 2 cores; the matrix is kept small (about a minute and a half).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import time

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the DSL is imported anywhere

from jaxflash.kernels.policy.choose import schedule_for  # noqa: E402
from jaxflash.kernels.variants.fwd import FwdConfig, can_implement  # noqa: E402

cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is not installed")

# Every head dim, both dtypes, every mask feature (causal, window, softcap, q/kv lengths), the
# persistent loop, the tile pipe, at least once.
MATRIX = [
    FwdConfig(dtype="bfloat16", head_dim=64),
    FwdConfig(dtype="float16", head_dim=64, is_causal=True),
    FwdConfig(dtype="bfloat16", head_dim=96, has_window=True),
    FwdConfig(dtype="bfloat16", head_dim=128, is_causal=True),
    FwdConfig(dtype="float16", head_dim=128, has_softcap=True, has_q_seqlen=True,
              has_kv_seqlen=True),
    FwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, has_window=True),
    FwdConfig(dtype="bfloat16", head_dim=192, is_causal=True),
    FwdConfig(dtype="float16", head_dim=192, has_kv_seqlen=True),
    FwdConfig(dtype="bfloat16", head_dim=256),
    FwdConfig(dtype="bfloat16", head_dim=256, is_causal=True, has_softcap=True),
    # the persistent tile loop, with and without a separate O buffer
    FwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, persistent=True),
    FwdConfig(dtype="bfloat16", head_dim=256, persistent=True),
    # the tile pipe (the producer hands tile coordinates to the consumers through smem)
    FwdConfig(dtype="bfloat16", head_dim=128, lazy_rescale=True),  # FA4's conditional rescale
    FwdConfig(dtype="float16", head_dim=64, tile_m=192, is_causal=True, has_softcap=True,
              lazy_rescale=True),
    FwdConfig(dtype="float16", head_dim=128, persistent=True, tile_pipe=True, has_q_seqlen=True,
              has_kv_seqlen=True),
    # three consumer warpgroups (192-row tiles, hdim 64: see below)
    FwdConfig(dtype="bfloat16", head_dim=64, tile_m=192),
    # ALiBi (runtime slopes) and segment ids (element compare + block skipping)
    FwdConfig(dtype="bfloat16", head_dim=128, has_alibi=True),
    FwdConfig(dtype="float16", head_dim=64, has_alibi=True, has_softcap=True, has_window=True),
    FwdConfig(dtype="bfloat16", head_dim=128, is_causal=True, has_segments=True, has_alibi=True,
              has_kv_seqlen=True),
    FwdConfig(dtype="bfloat16", head_dim=256, has_segments=True, is_causal=True,
              persistent=True),
]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.key)
def test_compiles_for_sm90a_with_wgmma(cfg, tmp_path):
    from devtools.standalone import compile_fwd
    t0 = time.time()
    compile_fwd(cfg, num_heads=8, num_kv_heads=2, arch="sm_90a", dump_dir=str(tmp_path))
    elapsed = time.time() - t0
    ptx_files = glob.glob(str(tmp_path / "*.ptx"))
    assert ptx_files, "no PTX dumped"
    ptx = open(ptx_files[0]).read()
    assert ".target sm_90a" in ptx
    # Both GEMMs are wgmma with the tile's N: S = Q K^T (N = tile_n) and O += P V (N = hdv).
    dt = "bf16" if cfg.dtype == "bfloat16" else "f16"
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.{dt}.{dt}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.head_dim_v}k16.f32.{dt}.{dt}" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads/stores
    assert "ex2.approx" in ptx  # exp2 softmax
    assert "setmaxnreg" in ptx  # producer/consumer register split
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills in PTX
    if cfg.has_softcap:
        assert "tanh.approx" in ptx
    print(f"{cfg.key}: {elapsed:.1f} s")


# The 192-row tile at 160 registers per consumer thread: S (64) + P (32) + O (32) live
# together leave ~30 for everything else. It spilled (580 B dense, C7512 causal) until each
# block's QK GEMM got a fresh S fragment and the mask became one select per register; these
# keep it clean.
PTXAS_CLEAN = [
    FwdConfig(dtype="bfloat16", head_dim=64, tile_m=192),
    FwdConfig(dtype="bfloat16", head_dim=64, tile_m=192, is_causal=True),
    FwdConfig(dtype="float16", head_dim=64, tile_m=192, is_causal=True, has_q_seqlen=True,
              has_kv_seqlen=True),
    FwdConfig(dtype="bfloat16", head_dim=64, tile_m=192, has_window=True, has_softcap=True),
]


def _ptxas_clean(cfg, tmp_path, maxnreg):
    from devtools.standalone import compile_fwd
    from tests.common import check_hopper_sass, ptxas_report
    compile_fwd(cfg, arch="sm_90a", dump_dir=str(tmp_path))
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    report = ptxas_report(ptx, tmp_path)
    if report is None:
        pytest.skip("no usable ptxas")
    (tmp_path / "ptxas.txt").write_text(report)
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{maxnreg}" in ptx
    assert "C7512" not in report and "serialized" not in report, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
    check_hopper_sass(ptx, tmp_path, "HGMMA")


@pytest.mark.parametrize("cfg", PTXAS_CLEAN, ids=lambda c: c.key)
def test_192_row_tiles_are_ptxas_clean(cfg, tmp_path):
    _ptxas_clean(cfg, tmp_path, 160)


# 64-row tiles at two CTAs per SM (`ctas_per_sm=2`): the launch bound makes ptxas fit 128
# registers per thread at launch (two 256-thread CTAs fill the register file) and the consumer
# warpgroup raises itself to 232; 0 spills at hd 64 / 128, dense and causal pairs (the last
# two: what dispatch picks at causal 1k).
PTXAS_CLEAN_TWO_CTAS = [
    FwdConfig(head_dim=128, tile_m=64, ctas_per_sm=2, num_stages=1, persistent=True,
              tile_pipe=True),
    *(FwdConfig(head_dim=d, tile_m=64, ctas_per_sm=2, tile_n=64, is_causal=True,
                persistent=True, tile_pipe=True, tile_order="pairs") for d in (64, 128)),
]


def _launch_regs(threads: int, ctas_per_sm: int) -> int:
    """Registers per thread at launch: the launch bound (min CTAs per SM) divides the SM's
    65536, in whole 8-register steps."""
    return min(255, 65536 // (threads * ctas_per_sm)) // 8 * 8


def _register_pool_ok(kernel, ctas_per_sm: int) -> bool:
    """setmaxnreg.inc only takes registers that the CTA's own setmaxnreg.dec gave back: the
    consumers' raise must fit in what the producer warpgroup (128 threads) released."""
    launch = _launch_regs(kernel.num_threads, ctas_per_sm)
    consumers = kernel.num_threads - 128
    return (kernel.mma_regs - launch) * consumers <= (launch - kernel.producer_regs) * 128


def test_setmaxnreg_raises_fit_the_registers_the_producer_frees():
    """Every forward and backward variant the checks, the grid and dispatch run can complete
    its consumers' setmaxnreg.inc (otherwise it waits forever: 128-row tiles at two CTAs per
    SM hung on the H200 with 24 / 112 at 80 registers, 1024 registers short per CTA; removed,
    and refused by `FwdConfig`)."""
    from devtools import bwd_devrun
    from devtools import devrun
    from jaxflash.kernels.sm90.bwd import FlashBwdSm90
    from jaxflash.kernels.sm90.fwd import FlashFwdSm90
    fwd = {FwdConfig(**kw).key: FwdConfig(**kw) for _, kw, _ in devrun.CHECKS}
    fwd.update({c.key: c for c in devrun.grid_choices()})
    for c in fwd.values():
        assert _register_pool_ok(FlashFwdSm90(c), c.ctas_per_sm), c.key
    for _, kw, _ in bwd_devrun.CHECKS:
        c = bwd_devrun._configs(kw)[1]
        assert _register_pool_ok(FlashBwdSm90(c), 1), c.key
    # the arithmetic of the one that hung: 80 at launch, 128 x 56 freed, 256 x 32 wanted
    hung = FlashFwdSm90(FwdConfig(head_dim=64, tile_m=64, ctas_per_sm=2, tile_n=64))
    hung.num_threads, hung.producer_regs, hung.mma_regs = 384, 24, 112
    assert _launch_regs(384, 2) == 80 and not _register_pool_ok(hung, 2)


# 256-row tiles at hd 64 (four consumer warpgroups): 640 threads launch at
# 96 registers, the producer drops to 24 and the consumers rise to 112 (128 x 72 >= 512 x 16);
# 0 spills, no serialized wgmma, dense, causal pairs and windowed with lengths.
PTXAS_CLEAN_M256 = [
    FwdConfig(head_dim=64, tile_m=256, tile_n=64, persistent=True, tile_pipe=True, mask_skip=True),
    FwdConfig(head_dim=64, tile_m=256, tile_n=64, is_causal=True, persistent=True,
              tile_pipe=True, tile_order="pairs", mask_select=True),
    FwdConfig(dtype="float16", head_dim=64, tile_m=256, tile_n=64, has_window=True,
              has_q_seqlen=True, has_kv_seqlen=True, mask_select=True),
]


@pytest.mark.parametrize("cfg", PTXAS_CLEAN_M256, ids=lambda c: c.key)
def test_256_row_tiles_are_ptxas_clean(cfg, tmp_path):
    _ptxas_clean(cfg, tmp_path, 112)
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    assert ".reqntid 640" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t112" in ptx
    report = open(tmp_path / "ptxas.txt").read()
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 96, report


# (config, consumer registers after setmaxnreg, registers at launch)
@pytest.mark.parametrize("cfg,consumer_regs,launch_regs",
                         [(c, 232, 128) for c in PTXAS_CLEAN_TWO_CTAS],
                         ids=lambda c: getattr(c, "key", str(c)))
def test_two_ctas_per_sm_tiles_are_ptxas_clean(cfg, consumer_regs, launch_regs, tmp_path):
    _ptxas_clean(cfg, tmp_path, consumer_regs)
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    assert ".minnctapersm 2" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    report = open(tmp_path / "ptxas.txt").read()
    assert re.search(r"Used (\d+) registers", report) and \
        int(re.search(r"Used (\d+) registers", report).group(1)) <= launch_regs, report


def test_mask_skip_is_ptxas_clean_and_branches_over_the_compares(tmp_path):
    """`mask_skip` on the hd 128 1k dense pick: 0 spills, and the masked block's
    compares sit behind a branch of their own (2 more branches in the PTX, 32 fewer selects;
    the SASS went from 2816 to 2744 instructions)."""
    on = FwdConfig(head_dim=128, persistent=True, tile_pipe=True, wg_epilogue=True,
                   mask_skip=True)
    assert on.key.endswith("_msk_dense")
    _ptxas_clean(on, tmp_path, 240)
    from devtools.standalone import compile_fwd
    (tmp_path / "off").mkdir()
    compile_fwd(dataclasses.replace(on, mask_skip=False), arch="sm_90a",
                dump_dir=str(tmp_path / "off"))
    ptx = {k: open(glob.glob(str(d / "*.ptx"))[0]).read()
           for k, d in (("on", tmp_path), ("off", tmp_path / "off"))}
    bra = {k: len(re.findall(r"\bbra", v)) for k, v in ptx.items()}
    assert bra["on"] > bra["off"], bra


# The select-form mask on the causal picks (`mask_select`): 0 spills, and one
# select per score instead of the conditional stores' cascade (the hd 128 4k pick went from
# 4544 to 2560 SASS instructions with ptxas 13.0).
PTXAS_CLEAN_SELECT = [
    (FwdConfig(head_dim=128, is_causal=True, persistent=True, tile_pipe=True,
               tile_order="pairs", mask_select=True), 240),
    (FwdConfig(head_dim=128, tile_m=64, ctas_per_sm=2, tile_n=64, is_causal=True,
               persistent=True, tile_pipe=True, tile_order="pairs", mask_select=True), 232),
]


@pytest.mark.parametrize("cfg,maxnreg", PTXAS_CLEAN_SELECT, ids=lambda c: getattr(c, "key", ""))
def test_mask_select_is_ptxas_clean_and_selects_once_per_score(cfg, maxnreg, tmp_path):
    _ptxas_clean(cfg, tmp_path, maxnreg)
    from devtools.standalone import compile_fwd
    (tmp_path / "off").mkdir()
    compile_fwd(dataclasses.replace(cfg, mask_select=False), arch="sm_90a",
                dump_dir=str(tmp_path / "off"))
    selp = {k: len(re.findall(r"\bselp\.", open(glob.glob(str(d / "*.ptx"))[0]).read()))
            for k, d in (("on", tmp_path), ("off", tmp_path / "off"))}
    assert 2 * selp["on"] < selp["off"], selp


def test_segment_variants_use_the_smaller_tiles():
    assert FwdConfig(head_dim=192, has_segments=True).tile_n == 80
    assert FwdConfig(head_dim=256, has_segments=True).tile_n == 64
    assert FwdConfig(head_dim=128, has_segments=True).tile_n == 128


def test_alibi_segments_launch_compiles_through_the_bridge():
    """The bridge's launch with ALiBi slopes [1, N] and the four segment tensors compiles."""
    from jaxflash.ffi.compiler import compile_launch
    from jaxflash.kernels.variants.fwd_launch import fwd_launch
    launch = fwd_launch(FwdConfig(head_dim=64, is_causal=True, has_alibi=True,
                                  has_segments=True, has_q_seqlen=True))
    assert [t.shape for t in launch.inputs][3:] == [(None,), (1, None), (None, None),
                                                    (None, None), (None, None, 4),
                                                    (None, None, 2)]
    assert len(compile_launch(launch)) > 10_000


def test_compiles_through_the_bridge():
    """The launch the XLA bridge builds (dynamic batch, lengths and head counts) compiles."""
    from jaxflash.ffi.compiler import compile_launch
    from jaxflash.kernels.variants.fwd_launch import fwd_launch
    cfg = FwdConfig(dtype="bfloat16", head_dim=64, is_causal=True, has_window=True,
                    has_q_seqlen=True)
    launch = fwd_launch(cfg)
    assert [t.shape for t in launch.inputs] == [(None, None, None, 64)] * 3 + [(None,)]
    assert launch.int_scalars == ("window_left", "window_right")
    module = compile_launch(launch)
    assert len(module) > 10_000


@pytest.mark.parametrize("kw, why", [
    (dict(head_dim=80), "head_dim 80"),
    (dict(head_dim=128, head_dim_v=64), "head_dim_v"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(head_dim=256, tile_n=128), "shared memory"),
    (dict(tile_m=64), "tile_m"),
    (dict(head_dim=128, tile_m=192), "tile_m 192"),
    (dict(tile_n=72), "tile_n"),
    (dict(tile_order="random"), "tile_order"),
    (dict(is_causal=True, tile_order="lpt"), "tile_order"),
    (dict(head_dim=64, tile_m=128, tile_n=64, ctas_per_sm=2), "ctas_per_sm"),
    (dict(head_dim=64, tile_m=192, is_causal=True, mask_select=True), "mask_select"),
    (dict(tile_pipe=True), "tile_pipe needs persistent"),
])
def test_invalid_configs_are_refused(kw, why):
    with pytest.raises(ValueError, match=why):
        FwdConfig(**kw)


@pytest.mark.parametrize("facts, ok, why", [
    (dict(dtype="bfloat16", head_dim=128, features=("causal", "softcap")), True, ""),
    (dict(dtype="float32", head_dim=128), False, "dtype"),
    (dict(dtype="bfloat16", head_dim=80), False, "head dim 80"),
    (dict(dtype="bfloat16", head_dim=128, head_dim_v=64), False, "value head dim"),
    (dict(dtype="float16", head_dim=64, features=("bias",)), False, "bias"),
    (dict(dtype="float16", head_dim=64, features=("alibi", "segment_ids", "causal")), True, ""),
    (dict(dtype="float16", head_dim=64, features=("mask", "alibi")), False, "mask"),
])
def test_can_implement(facts, ok, why):
    got, reason = can_implement(**facts)
    assert got is ok
    assert why in reason


def test_kernel_class_can_implement():
    from jaxflash.kernels.sm90.fwd import FlashFwdSm90
    assert FlashFwdSm90.can_implement(FwdConfig(head_dim=64)) == (True, "")


def test_config_for_problem():
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import forward_config as config_for
    st = AttentionStatics(scale=0.1, is_causal=True, window=(8, 0), softcap=5.0)
    p = Problem(batch=2, q_len=10, kv_len=12, num_heads=4, num_kv_heads=2, head_dim=64,
                head_dim_v=64, dtype="bfloat16", statics=st, has_kv_seqlen=True)
    cfg = config_for(p)
    assert (cfg.is_causal, cfg.has_window, cfg.has_softcap, cfg.has_q_seqlen,
            cfg.has_kv_seqlen, cfg.has_alibi, cfg.has_segments) == (
                True, True, True, False, True, False, False)
    cfg = config_for(Problem(**{**p.__dict__, "has_alibi": True, "has_segments": True}))
    assert (cfg.has_alibi, cfg.has_segments) == (True, True)
    assert cfg.key.endswith("causal-window-softcap-kvlen-alibi-seg")
    with pytest.raises(ValueError, match="bias"):
        config_for(Problem(**{**p.__dict__, "bias_shape": (1, 1, 10, 12)}))
    with pytest.raises(ValueError, match="empty"):
        config_for(Problem(**{**p.__dict__, "q_len": 0}))


@pytest.mark.parametrize("D,S,causal,extra,want", [
    # dense S <= 2k at hd 64: four 64-row consumer warpgroups (256 rows), mask_skip
    (64, 1024, False, {}, dict(tile_m=256, tile_n=64, persistent=True, tile_pipe=True,
                               mask_skip=True, wg_epilogue=False)),
    (64, 1000, False, {"has_kv_seqlen": True}, dict(tile_m=256, mask_skip=True)),
    (64, 1024, False, {"softcap": 30.0}, dict(tile_m=192, persistent=True, mask_skip=False)),
    (64, 2048, False, {}, dict(tile_m=256, persistent=True, mask_skip=True)),
    (64, 3072, False, {}, dict(tile_m=192, persistent=False, mask_skip=True)),
    # causal S <= 1k at hd 64 / 128: 64-row tiles, two CTAs per SM, paired tiles
    (64, 1024, True, {}, dict(tile_m=64, ctas_per_sm=2, tile_n=64, persistent=True,
                              tile_pipe=True, tile_order="pairs")),
    (64, 2048, True, {}, dict(tile_m=192, persistent=True, ctas_per_sm=1)),
    (64, 1024, True, {"softcap": 30.0}, dict(tile_m=192, persistent=True)),
    (64, 4096, True, {}, dict(tile_m=192, persistent=True, wg_epilogue=False)),
    (64, 4096, False, {}, dict(tile_m=192, persistent=False)),
    (64, 16384, True, {}, dict(tile_m=192, num_stages=2, persistent=False)),
    (128, 1024, True, {}, dict(tile_m=64, ctas_per_sm=2, tile_n=64, persistent=True,
                               tile_pipe=True, tile_order="pairs")),
    (128, 2048, True, {}, dict(tile_m=128, ctas_per_sm=1, persistent=True, tile_pipe=True,
                               tile_order="pairs")),
    (128, 1024, True, {"softcap": 30.0}, dict(persistent=True, tile_order="auto")),
    (128, 1024, False, {}, dict(persistent=True, tile_pipe=True, num_stages=2, wg_epilogue=True)),
    (128, 4096, False, {}, dict(persistent=True, tile_pipe=True, wg_epilogue=False)),
    (128, 4096, True, {}, dict(persistent=True, tile_pipe=True, tile_order="pairs")),
    (128, 4096, True, {"softcap": 30.0}, dict(persistent=False)),
    (256, 1024, True, {}, dict(persistent=True, tile_pipe=True, tile_order="pairs")),
    (256, 16384, True, {}, dict(persistent=False, lazy_rescale=True)),
    (256, 4096, False, {}, dict(persistent=True, tile_pipe=True)),
    (256, 16384, False, {}, dict(persistent=False)),
    # (three stages lost; pairs not picked at 16k)
    (128, 16384, True, {}, dict(num_stages=2, persistent=False, tile_order="auto")),
    # key lengths take the plain call's schedule (feat_bench); query lengths not
    (64, 1024, True, {"has_kv_seqlen": True}, dict(tile_m=64, ctas_per_sm=2,
                                                   tile_order="pairs", mask_select=True)),
    (64, 1024, True, {"has_q_seqlen": True}, dict(tile_m=128, persistent=False)),  # default
    (64, 1024, True, {"has_segments": True}, dict(tile_m=128, persistent=False)),
])
def test_config_for_picks_the_measured_schedule(D, S, causal, extra, want):
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import forward_config as config_for
    softcap = extra.pop("softcap", None) if extra else None
    p = Problem(batch=2, q_len=S, kv_len=S, num_heads=4, num_kv_heads=4, head_dim=D,
                head_dim_v=D, dtype="bfloat16",
                statics=AttentionStatics(0.1, is_causal=causal, softcap=softcap), **extra)
    cfg = config_for(p)
    assert {k: getattr(cfg, k) for k in want} == want


def test_backward_config_uses_early_dv_only_where_measured():
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import backward_config as config_for
    def cfg(D, **st):
        return config_for(Problem(batch=1, q_len=256, kv_len=256, num_heads=2, num_kv_heads=2,
                                  head_dim=D, head_dim_v=D, dtype="bfloat16",
                                  statics=AttentionStatics(0.1, **st)))
    assert cfg(128, is_causal=True).early_dv
    assert not cfg(64, is_causal=True).early_dv
    assert not cfg(128, softcap=3.0).early_dv
    assert not cfg(128, deterministic=True).early_dv


def test_variant_key_distinguishes_features():
    keys = {c.key for c in MATRIX}
    assert len(keys) == len(MATRIX)


# -- ptxas: the wgmma of the benchmark variants must not be serialized --------------------------
BENCH_VARIANTS = [FwdConfig(head_dim=d, is_causal=c) for d in (64, 128, 256) for c in (False, True)]
# ALiBi / segment variants at the register-heaviest points (tile sizes chosen by this check).
BENCH_VARIANTS += [FwdConfig(head_dim=128, is_causal=True, has_alibi=True, has_segments=True),
                   FwdConfig(head_dim=192, is_causal=True, has_alibi=True, has_segments=True),
                   FwdConfig(head_dim=256, has_segments=True)]
# The persistent loop at the points it once lost (every wgmma serialized: the stale S of a
# zero-init GEMM kept live; see layouts.wgmma's ``clear``), with and without the tile pipe.
BENCH_VARIANTS += [FwdConfig(head_dim=d, persistent=True, tile_pipe=tp) for d in (128, 256)
                   for tp in (False, True)]
BENCH_VARIANTS += [FwdConfig(head_dim=64, is_causal=True, persistent=True, tile_pipe=True)]
# The schedules `choose.forward_config` picks from measurements (192 rows at hdim 64,
# persistent at 1k for hdim 128).
BENCH_VARIANTS += sorted({FwdConfig(head_dim=d, is_causal=c, **schedule_for(d, s, c))
                          for d in (64, 128, 256) for s in (1024, 16384) for c in (False, True)
                          if schedule_for(d, s, c)}, key=lambda c: c.key)


def _ptxas_report(cfg, tmp_path):
    """ptxas -v messages for the variant's PTX (None if no usable ptxas here). The DSL emits a
    newer PTX ISA than the CUDA 13.0 ptxas reads; the kernels use nothing newer, so the version
    line is lowered for this check only."""
    import shutil
    import subprocess
    from devtools.standalone import compile_fwd
    if shutil.which("ptxas") is None:
        return None
    compile_fwd(cfg, num_heads=8, num_kv_heads=8, arch="sm_90a", dump_dir=str(tmp_path))
    src = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    lines = src.split("\n", 40)
    for i, line in enumerate(lines[:40]):
        if line.startswith(".version"):
            lines[i] = ".version 9.0"
    (tmp_path / "k.ptx").write_text("\n".join(lines))
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                        str(tmp_path / "k.cubin")], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return r.stdout + r.stderr


@pytest.mark.parametrize("cfg", BENCH_VARIANTS, ids=lambda c: c.key)
def test_wgmma_not_serialized(cfg, tmp_path):
    report = _ptxas_report(cfg, tmp_path)
    if report is None:
        pytest.skip("no ptxas able to assemble the DSL's PTX here")
    assert "C7512" not in report, "ptxas serialized the wgmma (insufficient registers)"
    assert " 0 bytes spill stores" in report


# -- the coordinate decomposition `TileCoords` relies on ------------------------------------------
@pytest.mark.parametrize("tile_n, hdv", [(128, 128), (64, 256)])
def test_tile_coords_are_base_plus_thread0_offsets(tile_n, hdv):
    """A register's (row, col) = its thread's first coordinate + thread 0's coordinate of the
    same register, for every consumer thread of both GEMMs (what the masks and the LSE/row
    predicates use instead of a per-register coordinate tensor)."""
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import warpgroup
    from jaxflash.kernels.common.layouts import acc_as_rows_cols

    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    result = {}

    @cute.jit
    def probe():
        bad = 0
        total = 0
        mma = None
        shape = None
        for kind in cutlass.range_constexpr(2):
            if cutlass.const_expr(kind == 0):
                mma = sm90.make_trivial_tiled_mma(
                    cutlass.BFloat16, cutlass.BFloat16, K, K, cutlass.Float32,
                    atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tile_n))
                shape = (128, tile_n)
            else:
                mma = sm90.make_trivial_tiled_mma(
                    cutlass.BFloat16, cutlass.BFloat16, K, MN, cutlass.Float32,
                    atom_layout_mnk=(2, 1, 1), tiler_mn=(64, hdv),
                    a_source=warpgroup.OperandSource.RMEM)
                shape = (128, hdv)
            ident = cute.make_identity_tensor(shape)
            t0 = acc_as_rows_cols(mma.get_slice(0).partition_C(ident))
            for t in cutlass.range_constexpr(256):
                part = mma.get_slice(t).partition_C(ident)
                mine = acc_as_rows_cols(part)
                base = part[0]
                for r in cutlass.range_constexpr(cute.size(mine, mode=[0])):
                    for j in cutlass.range_constexpr(cute.size(mine, mode=[1])):
                        a = mine[r, j]
                        b = t0[r, j]
                        bad += int(a[0] != base[0] + b[0] or a[1] != base[1] + b[1])
                        total += 1
        result["bad"], result["total"] = bad, total

    from jaxflash.ffi.compiler import target_arch
    with target_arch("sm_90a"):  # another test in this process may have targeted sm_100a
        probe()
    assert result["total"] == 256 * (tile_n + hdv) // 2  # 2 rows x (N/4 cols) per thread
    assert result["bad"] == 0
