"""The FP4 Direct-P kernel's static facts, checked in Python before anything is traced (no DSL):
its tensor-memory plan (at most 512 columns; the P codes and their E8M0 scale page only over
retired columns of their own S buffer; a bad overlay is refused), the scale-chunk byte order,
the policy parameters it compiles in (from `jaxflash.fp4.constants`, the emulator's module).
"""
from __future__ import annotations

import dataclasses

import pytest

from jaxflash.fp4 import constants as C
from jaxflash.kernels.variants import sm100_fwd_fp4 as V
from jaxflash.kernels.variants import tmem_plan
from jaxflash.kernels.variants.sm100_fwd_fp4 import Sm100FwdFp4Config


def _replace(plan, name, **kw):
    regions = tuple(dataclasses.replace(r, **kw) if r.name == name else r for r in plan.regions)
    return dataclasses.replace(plan, regions=regions)


@pytest.mark.parametrize("hd", V.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("policy", sorted(C.POLICIES))
def test_every_plan_fits_and_overlays_only_retired_s_columns(hd, policy):
    cfg = Sm100FwdFp4Config(head_dim=hd, policy=policy)
    plan = cfg.tmem_plan()
    assert plan.check() == (True, "")
    assert max(r.end for r in plan.regions) <= tmem_plan.TMEM_COLUMNS == plan.alloc_cols
    s0, s1, o = plan.region("S0"), plan.region("S1"), plan.region("O")
    for p, s in ((plan.region("P0"), s0), (plan.region("P1"), s1)):
        assert s.start <= p.start and p.end <= s.end
        assert p.cols == V.P_PAYLOAD_COLS + V.P_HALVES * V.P_PAGE_COLS == 24  # 16 + 2 x 4
        assert not p.overlaps(o)
    # the scale sets (Q once, K / V double-buffered) have columns of their own
    sf = [r for r in plan.regions if r.kind == "SF"]
    assert [r.name for r in sf] == ["SFQ", "SFK0", "SFK1", "SFV0", "SFV1"]
    assert all(r.start % 4 == 0 for r in sf)
    assert sf[0].cols == hd // 16 and sf[-1].cols == 4


def test_overlay_on_the_live_o_bank_fails():
    plan = Sm100FwdFp4Config().tmem_plan()
    o = plan.region("O")
    bad = _replace(plan, "P1", start=o.start, buffer=1)
    ok, why = bad.check()
    assert not ok and ("O" in why or "outside" in why), why


def test_overlay_on_a_scale_set_fails():
    plan = Sm100FwdFp4Config().tmem_plan()
    bad = _replace(plan, "P0", start=plan.region("SFK0").start)
    ok, why = bad.check()
    assert not ok and "SFK0" in why, why


def test_overlay_on_the_other_s_buffer_fails():
    plan = Sm100FwdFp4Config().tmem_plan()
    bad = _replace(plan, "P0", start=plan.region("S1").start)   # still marked buffer 0
    ok, why = bad.check()
    assert not ok and "S1" in why, why


def test_scale_page_before_the_scores_are_read_fails():
    """The page written while the softmax still has S columns to read: refused."""
    plan = Sm100FwdFp4Config().tmem_plan()
    order = (("load", 0, 16), ("store", 16, 4)) + tuple(
        op for op in plan.softmax_order if op[0] == "load")
    ok, why = dataclasses.replace(plan, softmax_order=order).check()
    assert not ok and "not read yet" in why, why


def test_more_than_512_columns_fail():
    plan = Sm100FwdFp4Config().tmem_plan()
    ok, why = _replace(plan, "SFV1", start=510).check()
    assert not ok and "outside" in why, why


def test_config_refuses_a_bad_plan(monkeypatch):
    real = Sm100FwdFp4Config.tmem_plan
    monkeypatch.setattr(Sm100FwdFp4Config, "tmem_plan",
                        lambda self: _replace(real(self), "P0", start=260))
    with pytest.raises(ValueError, match="P0 overlaps live O"):
        Sm100FwdFp4Config()


def test_scale_atom_offset_is_a_bijection_on_each_chunk():
    for blocks in (4, 8):
        seen = {V.scale_atom_offset(r, b) for r in range(128) for b in range(blocks)}
        assert seen == set(range(128 * blocks))
    assert V.scale_atom_offset(33, 2) == 16 * 1 + 4 * 1 + 2
    with pytest.raises(ValueError):
        V.scale_atom_offset(128, 0)


def test_policy_parameters_come_from_the_emulators_constants():
    fast, acc = Sm100FwdFp4Config(policy="fast"), Sm100FwdFp4Config(policy="accurate")
    assert fast.params is C.POLICIES["fast"] and acc.params is C.POLICIES["accurate"]
    assert not any(fast.native_pair(p) for p in range(16))
    assert [p for p in range(16) if acc.native_pair(p)] == [0, 4, 8, 12]   # 25 % of pairs
    assert not fast.has_row_ref and acc.has_row_ref
    assert Sm100FwdFp4Config(guard_shift=16).has_row_ref


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=256), "head_dim"), (dict(policy="nope"), "policy"),
    (dict(guard_shift=127), "M \\+ L"), (dict(num_stages=0), "num_stages"),
    (dict(out_dtype="float16"), "bfloat16")])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sm100FwdFp4Config(**kw)


def test_operand_shapes_and_can_implement():
    cfg = Sm100FwdFp4Config(policy="accurate")
    s = cfg.operand_shapes(B=2, T=300, S=1000, N=8, K=2)
    assert s["q"] == (2, 300, 8, 64) and s["vt"] == (2, 2, 128, 512)
    assert s["sfq"] == (2, 8, 3, 1024) and s["sfk"] == (2, 2, 8, 1024)
    assert s["sfv"] == (2, 2, 8, 512) and s["m_ref"] == (2, 8, 300)
    assert V.can_implement(head_dim=128) == (True, "")
    assert not V.can_implement(head_dim=128, is_causal=True)[0]
    assert not V.can_implement(head_dim=96)[0]


def test_a_block_exponent_rule_the_kernel_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(C, "P_SCALE_RULE", "ceil")
    with pytest.raises(ValueError, match="'ocp' block-exponent rule"):
        Sm100FwdFp4Config()


def test_the_code_sum_table_is_the_formats_e2m1_table():
    from jaxflash.fp4 import formats as F
    assert F.E2M1_VALUES is C.E2M1_VALUES and max(C.E2M1_VALUES) == C.E2M1_MAX
