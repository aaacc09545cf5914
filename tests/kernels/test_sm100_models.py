"""The sm_100a forward's new arithmetic and tensor-memory plan, checked on the CPU (no DSL):

- the polynomial exp2 (`variants.exp2_poly.model_exp2`, a bit-exact model of the instruction
  sequence the kernel emits) against 2**x over its whole input range;
- conditional rescaling (`model_online_softmax`): a reference max that lags the true max by up
  to the threshold leaves the normalized output unchanged within bfloat16 rounding;
- the tensor-memory plan (`variants.tmem_plan`): at most 512 columns, P only over retired
  columns of its own S buffer, never over O.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jaxflash.kernels.variants import exp2_poly, tmem_plan
from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig

# Stated bound: relative error 8.6e-5 (2**-13.5), i.e. at most 1437 float32 ulps.
MAX_ULP = 1437
MAX_REL = 8.6e-5


def _fraction_grid():
    """x = f - 1 for every f on the 2**-24 grid of [0, 1]: every fraction step 4 of the
    sequence can produce (|x| >= 1 gives multiples of 2**-23, |x| < 1 rounds x + 1 to this
    grid), so this covers the polynomial's whole input range."""
    f = np.arange(2 ** 24 + 1, dtype=np.float64) / 2 ** 24
    return (f - 1.0).astype(np.float32)


def test_poly_exp2_max_error_over_every_fraction():
    x = _fraction_grid()
    y = exp2_poly.model_exp2(x)
    ulp = exp2_poly.ulp_error(y, x)
    rel = np.abs(y.astype(np.float64) / np.exp2(x.astype(np.float64)) - 1.0)
    assert ulp.max() <= MAX_ULP and rel.max() <= MAX_REL, (ulp.max(), rel.max())
    assert ulp.max() > 1000  # the bound is tight (a polynomial this short cannot be exact)


def test_poly_exp2_error_is_the_fraction_error_at_every_exponent():
    """Steps 1-4 and 6 are exact, so for every integer part the error in ulps of the result
    equals the fraction's: check the full normal range x in [-126, 127) on a dense sample."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-126.0, 127.0, 1_000_000).astype(np.float32)
    ulp = exp2_poly.ulp_error(exp2_poly.model_exp2(x), x)
    assert ulp.max() <= MAX_ULP
    ints = np.arange(-126, 127, dtype=np.float32)
    np.testing.assert_array_equal(exp2_poly.model_exp2(ints), np.exp2(ints))  # p(0) = 1


def test_poly_exp2_masked_scores_become_zero():
    x = np.array([-np.inf, -1e30, -300.0, -127.0], np.float32)
    np.testing.assert_array_equal(exp2_poly.model_exp2(x), np.zeros(4, np.float32))


def test_poly_exp2_in_bfloat16_differs_by_at_most_one_ulp():
    x = _fraction_grid()[::7]
    got = exp2_poly.model_exp2(x).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = np.exp2(x.astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)
    want = want.astype(np.float64)
    bf16_ulp = np.exp2(np.floor(np.log2(want)) - 7)
    diff = np.abs(got - want) / bf16_ulp
    assert diff.max() <= 1.0
    assert (diff > 0).mean() < 0.05  # rounding flips only near bf16 midpoints


def test_fma_model_rounds_once():
    """The FFMA model's double-rounding repair: a case where float64 then float32 rounding
    differs from one rounding of the exact value."""
    a = np.float32(1 + 2 ** -12)
    b = np.float32(1 + 2 ** -12)
    # exact a * b = 1 + 2**-11 + 2**-24; + c puts it half-way in float64 terms otherwise
    c = np.float32(-(2 ** -53)) if False else np.float32(2 ** -30)
    exact = (1 + 2 ** -12) ** 2 + 2 ** -30
    got = exp2_poly.fma_f32(a, b, c)
    lo = np.float32(exact)
    cands = [lo, np.nextafter(lo, np.float32(2)), np.nextafter(lo, np.float32(0))]
    best = min(cands, key=lambda v: abs(float(v) - exact))
    assert got == best


# -- conditional rescaling -------------------------------------------------------------------------
def _blocks(rng, rows=64, n=8, tile=128, d=64, drift=6.0):
    """Key blocks whose row max grows by less than the threshold now and then, so the lagging
    reference path (no rescale) is taken, plus one jump past it."""
    s, v = [], []
    for j in range(n):
        base = rng.normal(0, 1, (rows, tile)) + drift * j / n * 2.0
        if j == n - 1:
            base[:rows // 2] += 20.0  # a jump beyond the threshold: these rows rescale
        s.append(base.astype(np.float32))
        v.append(rng.normal(0, 1, (tile, d)).astype(np.float32))
    return s, v


@pytest.mark.parametrize("p_dtype", ["bfloat16", "float16"])
def test_rescale_threshold_keeps_output_within_rounding(p_dtype):
    rng = np.random.default_rng(1)
    s, v = _blocks(rng)
    scale_log2 = 0.125 * np.log2(np.e) * 8  # scores in log2 units span several octaves
    exact, _ = exp2_poly.model_online_softmax(s, v, scale_log2, 0.0, p_dtype)
    lazy, _ = exp2_poly.model_online_softmax(s, v, scale_log2, 8.0, p_dtype)
    # float64 reference
    sc = np.concatenate(s, 1).astype(np.float64) * scale_log2
    p = np.exp2(sc - sc.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ np.concatenate(v, 0).astype(np.float64)
    out_dt = ml_dtypes.bfloat16 if p_dtype == "bfloat16" else np.float16
    eps = 2.0 ** (-8 if p_dtype == "bfloat16" else -11)
    scale = np.abs(ref).max()
    # both are within P's 16-bit rounding of the float64 result, and of each other
    for got in (exact, lazy):
        assert np.abs(got - ref).max() <= 2 * eps * scale
    assert np.abs(lazy - exact).max() <= 2 * eps * scale
    # and the lagging reference does not make the rounding error grow (RMS against float64)
    rms = lambda o: np.sqrt(np.mean((o.astype(out_dt).astype(np.float64) - ref) ** 2))
    assert rms(lazy) <= 1.25 * rms(exact), (rms(lazy), rms(exact))


def test_rescale_threshold_skips_rescales():
    """The threshold is taken: with drift below 8 octaves per block, most blocks keep the
    reference (fewer rescales than with threshold 0), and probabilities stay <= 2**8."""
    rng = np.random.default_rng(2)
    s, v = _blocks(rng, drift=3.0)
    scale_log2 = 1.0
    ref = np.full(s[0].shape[0], -np.inf, np.float32)
    moved = 0
    for blk in s:
        m = np.maximum(ref, blk.max(1))
        with np.errstate(invalid="ignore"):
            grow = (m - ref) * scale_log2 > 8.0
        moved += grow[np.isfinite(ref)].sum()
        ref = np.where(grow, m, ref)
        assert np.exp2(blk * scale_log2 - ref[:, None]).max() <= 2.0 ** 8
    assert moved < len(s) * s[0].shape[0] / 2


# -- tensor-memory plan ------------------------------------------------------------------------------
@pytest.mark.parametrize("hd", [64, 96, 128, 192, 256])
def test_every_forward_plan_fits(hd):
    cfg = Sm100FwdConfig(head_dim=hd)
    plan = cfg.tmem_plan()
    assert plan.check() == (True, "")
    assert max(r.end for r in plan.regions) <= tmem_plan.TMEM_COLUMNS
    assert plan.region("O").start >= plan.region("S1").end


@pytest.mark.parametrize("hd, two_cta, tile_n, stages, columns, smem_kb", [
    (96, False, 128, 3, 352, 24 + 3 * 48 + 4),
    (192, False, 64, 3, 320, 48 + 3 * 48 + 4),
    (192, True, 128, 3, 448, 48 + 3 * 48 + 4),  # per CTA: half of each K and V tile
])
def test_head_dims_96_and_192_tiles(hd, two_cta, tile_n, stages, columns, smem_kb):
    """The default tiles of the head dims beside the Hopper kernels' 64 / 128 / 256: tensor
    memory S0 | S1 | O and shared memory Q + stages x (K + V) within the SM's."""
    from jaxflash.kernels.variants.sm100_fwd import SMEM_LIMIT_BYTES
    cfg = Sm100FwdConfig(head_dim=hd, two_cta=two_cta)
    assert (cfg.tile_n, cfg.num_stages) == (tile_n, stages)
    plan = cfg.tmem_plan()
    assert plan.region("O").end == columns and plan.region("O").cols == hd
    assert cfg.smem_bytes() == smem_kb * 1024 <= SMEM_LIMIT_BYTES


def test_head_dim_192_with_128_key_tiles_does_not_fit_one_cta():
    """1-CTA: two 128-key stages of K and V beside Q are 240 KB (past 227 KB); refused before
    tracing. One stage would fit but serialize every QK MMA behind its K load."""
    with pytest.raises(ValueError, match="shared memory"):
        Sm100FwdConfig(head_dim=192, tile_n=128, num_stages=2)


def test_fp8_keeps_the_hopper_fp8_head_dims():
    """The FP8 forward serves the head dims the FP8 call rules (the Hopper FP8 forward's) do."""
    from jaxflash.kernels.variants.sm100_fwd_fp8 import Sm100Fp8FwdConfig
    for hd in (96, 192):
        with pytest.raises(ValueError, match="for FP8"):
            Sm100Fp8FwdConfig(head_dim=hd)
    for hd in (64, 128, 256):
        assert Sm100Fp8FwdConfig(head_dim=hd).tile_n == 128


def test_overlay_on_a_live_o_bank_fails():
    plan = tmem_plan.forward_plan(128, 128)
    o = plan.region("O")
    bad = [dataclasses.replace(r, start=o.start) if r.name == "P1" else r for r in plan.regions]
    ok, why = dataclasses.replace(plan, regions=tuple(bad)).check()
    assert not ok and "overlaps live O" in why


def test_overlay_on_the_other_s_buffer_fails():
    plan = tmem_plan.forward_plan(128, 128)
    bad = [dataclasses.replace(r, start=128) if r.name == "P0" else r for r in plan.regions]
    ok, why = dataclasses.replace(plan, regions=tuple(bad)).check()
    assert not ok and "overlaps live S1" in why


def test_overlay_before_the_scores_are_read_fails():
    """P stored over columns the softmax has not loaded yet (store issued after only the first
    load) would destroy scores: refused."""
    plan = tmem_plan.forward_plan(128, 128)
    order = (("load", 0, 32), ("store", 0, 64), ("load", 32, 96))
    ok, why = dataclasses.replace(plan, softmax_order=order).check()
    assert not ok and "not read yet" in why


def test_more_than_512_columns_fail():
    plan = tmem_plan.forward_plan(128, 384)  # S0 | S1 | O = 640 columns
    ok, why = plan.check()
    assert not ok and "outside" in why
    with pytest.raises(ValueError, match="head_dim"):
        Sm100FwdConfig(head_dim=384)


def test_config_refuses_a_bad_plan(monkeypatch):
    """The config asserts its plan before anything is traced."""
    real = tmem_plan.forward_plan
    monkeypatch.setattr(tmem_plan, "forward_plan",
                        lambda n, d, **kw: dataclasses.replace(
                            real(n, d), softmax_order=(("store", 0, 32),)))
    with pytest.raises(ValueError, match="not read yet"):
        Sm100FwdConfig(head_dim=128)


def test_register_budgets_fit_the_sm():
    """setmaxnreg budgets: the softmax's raise is covered by what the other two warpgroups
    give back, and the launch allocation fits the register file (384 threads)."""
    from jaxflash.kernels.variants.sm100_fwd import LAUNCH_REGS, REGS
    assert LAUNCH_REGS * 384 <= 65536 and LAUNCH_REGS % 8 == 0
    assert sum(REGS) <= 3 * LAUNCH_REGS
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in REGS)
    assert 128 * sum(REGS) <= 65536
