"""The sm_100a backward's static plan, checked on the CPU (no DSL): its tensor-memory plan
(`variants.tmem_plan.backward_plan`: at most 512 columns, P^T / dS^T only over score columns
their own warpgroup has read, dQ never over the live dK / dV accumulators; at head dim 256
the plans of its two passes), its register budgets, its shared memory, what the config
refuses, and that the shared XLA side reads it like the Hopper config.
"""
from __future__ import annotations

import dataclasses

import pytest

from jaxflash.kernels.variants import tmem_plan
from jaxflash.kernels.variants.sm100_bwd import (LAUNCH_REGS, REGS, SMEM_LIMIT_BYTES,
                                                 Sm100BwdConfig, can_implement, register_total)

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("hd", [64, 128])
def test_every_backward_plan_fits(hd):
    cfg = Sm100BwdConfig(head_dim=hd)
    plan = cfg.tmem_plan()
    assert plan.check() == (True, "")
    assert max(r.end for r in plan.regions) <= tmem_plan.TMEM_COLUMNS == plan.alloc_cols
    dq, dp = plan.region("dQ"), plan.region("dP^T")
    # hd 64: dQ has its own columns; hd 128: all 512 are S^T | dP^T | dV | dK, dQ over dP^T
    assert dq.overlaps(dp) == (hd == 128)
    for name in ("dV", "dK"):
        assert not dq.overlaps(plan.region(name))


def _swap(plan, name, **kw):
    regions = tuple(dataclasses.replace(r, **kw) if r.name == name else r for r in plan.regions)
    return dataclasses.replace(plan, regions=regions)


def test_dq_over_a_live_accumulator_fails():
    plan = tmem_plan.backward_plan(128, 128, 128)
    ok, why = _swap(plan, "dQ", start=plan.region("dK").start).check()
    assert not ok and "dQ overlaps dK, an accumulator live across the query loop" in why
    ok, why = tmem_plan.backward_plan(128, 64, 64, dq_start=256).check()  # over dV
    assert not ok and "dV" in why


def test_p_over_a_live_accumulator_fails():
    plan = tmem_plan.backward_plan(128, 128, 128)
    ok, why = _swap(plan, "P^T1", start=plan.region("dV").start).check()
    assert not ok and "overlaps live dV" in why


def test_p_over_the_other_warpgroups_columns_fails():
    """Warpgroup 1 writing its P^T over columns warpgroup 0 reads (as one contiguous P^T of 64
    columns would) races with warpgroup 0's loads, even if warpgroup 1 has read them too:
    refused; and without that read it is refused as a store before the load."""
    plan = tmem_plan.backward_plan(128, 128, 128)
    plan = _swap(plan, "P^T1", start=plan.region("S^T").start + 32)
    wg1 = (("load", 32, 32), ("load", 64, 64), ("store", 32, 32))
    order = tuple((key, wg1 if key == (0, 1) else steps) for key, steps in plan.order)
    ok, why = dataclasses.replace(plan, order=order).check()
    assert not ok and "another warpgroup reads" in why
    wg1 = (("load", 64, 64), ("store", 32, 32))
    order = tuple((key, wg1 if key == (0, 1) else steps) for key, steps in plan.order)
    ok, why = dataclasses.replace(plan, order=order).check()
    assert not ok and "before reading them" in why


def test_store_before_load_fails():
    plan = tmem_plan.backward_plan(128, 64, 64)
    order = tuple((key, (("store", 64 * key[1], 32),) + steps) for key, steps in plan.order)
    ok, why = dataclasses.replace(plan, order=order).check()
    assert not ok and "before reading them" in why


def test_config_refuses_a_bad_plan(monkeypatch):
    """The config asserts its plan before anything is traced."""
    real = tmem_plan.backward_plan
    monkeypatch.setattr(tmem_plan, "backward_plan",
                        lambda m, d, dv, **kw: real(m, d, dv, dq_start=256 + dv))
    with pytest.raises(ValueError, match="dQ overlaps dK"):
        Sm100BwdConfig(head_dim=128)


def test_head_dim_256_runs_as_two_passes():
    """hd 256: dK and dV alone would take all 512 columns, and K, V, Q, dO tiles of 128 x 256
    all of shared memory: the backward is a "dv" pass, then a "dkdq" pass of 64-query steps."""
    cfg = Sm100BwdConfig(head_dim=256, is_causal=True, deterministic=True)
    assert cfg.bwd_pass == "dv"
    dv, dkdq = cfg.passes()
    assert (dv.bwd_pass, dkdq.bwd_pass) == ("dv", "dkdq") and dv == cfg
    assert (dv.tile_m, dkdq.tile_m) == (128, 64)
    assert (dv.has_dv, dv.has_dkdq, dkdq.has_dv, dkdq.has_dkdq) == (True, False, False, True)
    assert dkdq.passes() == (dv, dkdq)  # either pass names the whole backward
    assert Sm100BwdConfig(head_dim=128).passes() == (Sm100BwdConfig(head_dim=128),)
    for c in (dv, dkdq):
        assert c.num_stages == 1 and c.smem_bytes() <= SMEM_LIMIT_BYTES
    assert dv.key != dkdq.key and "_dv_" in dv.key and "_dkdq_" in dkdq.key
    # the hd 64 / 128 keys (artifact names) are unchanged: no pass in them
    assert Sm100BwdConfig(head_dim=128).key == "bwd_sm100_bfloat16_h128_hv128_t128x128s1_dense"
    with pytest.raises(ValueError, match="runs as the passes"):
        Sm100BwdConfig(head_dim=256, bwd_pass="all")
    with pytest.raises(ValueError, match="one pass"):
        Sm100BwdConfig(head_dim=128, bwd_pass="dv")
    assert can_implement(dtype="bfloat16", head_dim=256, features=("causal",)) == (True, "")


def test_head_dim_256_pass_plans():
    dv = Sm100BwdConfig(head_dim=256).tmem_plan()
    dkdq = Sm100BwdConfig(head_dim=256, bwd_pass="dkdq").tmem_plan()
    for plan in (dv, dkdq):
        assert plan.check() == (True, "") and plan.alloc_cols == tmem_plan.TMEM_COLUMNS
        assert max(r.end for r in plan.regions) <= tmem_plan.TMEM_COLUMNS
    # "dv": S^T | dV, P^T over the S^T columns each warpgroup read
    assert {r.name for r in dv.regions} == {"S^T", "dV", "P^T0", "P^T1"}
    assert (dv.region("S^T").cols, dv.region("dV").cols) == (128, 256)
    # "dkdq": S^T | dP^T (64 queries each) | dK | dQ^T (two 128-dim halves x 64 queries)
    assert {r.name for r in dkdq.regions} == {"S^T", "dP^T", "dK", "dQ", "dS^T0", "dS^T1"}
    assert [(dkdq.region(n).start, dkdq.region(n).cols) for n in ("S^T", "dP^T", "dK", "dQ")] \
        == [(0, 64), (64, 64), (128, 256), (384, 128)]


def test_head_dim_256_overlays_over_live_accumulators_fail():
    """The pass plans refuse an overlay or dQ^T over an accumulator live across the query
    loop, as the one-pass plans do."""
    dv = tmem_plan.backward_plan(128, 256, 256, bwd_pass="dv")
    ok, why = _swap(dv, "P^T1", start=dv.region("dV").start).check()
    assert not ok and "overlaps live dV" in why
    dkdq = tmem_plan.backward_plan(64, 256, 256, bwd_pass="dkdq")
    ok, why = _swap(dkdq, "dS^T0", start=dkdq.region("dK").start).check()
    assert not ok and "overlaps live dK" in why
    ok, why = _swap(dkdq, "dQ", start=dkdq.region("dK").start + 128).check()
    assert not ok and "dQ overlaps dK, an accumulator live across the query loop" in why
    ok, why = tmem_plan.backward_plan(64, 256, 256, bwd_pass="dkdq", dq_start=100).check()
    assert not ok and "dK" in why
    # a warpgroup's dS^T store over the other's unread dP^T columns
    order = tuple((key, (("load", 32 * key[1], 32), ("store", 32 * (1 - key[1]), 16)))
                  for key, _ in dkdq.order)
    ok, why = dataclasses.replace(dkdq, order=order).check()
    assert not ok and "before reading them" in why


def test_refusals_with_the_reason():
    ok, why = can_implement(dtype="bfloat16", head_dim=96, features=())
    assert not ok and "head dim 96" in why
    ok, why = can_implement(dtype="bfloat16", head_dim=128, features=("score_mod",))
    assert not ok and "score_mod" in why
    with pytest.raises(ValueError, match="deterministic with segment ids"):
        Sm100BwdConfig(has_segments=True, deterministic=True)
    ok, why = can_implement(dtype="bfloat16", head_dim=128, features=("alibi", "softcap"))
    assert not ok and "ALiBi with softcap" in why
    with pytest.raises(ValueError, match="ALiBi with softcap"):
        Sm100BwdConfig(has_alibi=True, has_softcap=True)
    assert can_implement(dtype="float16", head_dim=64,
                         features=("causal", "window", "softcap", "seq_lengths")) == (True, "")
    assert can_implement(dtype="bfloat16", head_dim=128,
                         features=("alibi", "segment_ids")) == (True, "")


def test_register_budgets_fit_the_sm():
    """setmaxnreg budgets, one per warpgroup: the compute warpgroups' raise is covered by what
    the dQ reduce and MMA / load warpgroups give back (512 threads at 128)."""
    assert LAUNCH_REGS * 512 <= 65536 and LAUNCH_REGS % 8 == 0
    assert register_total() <= 4 * LAUNCH_REGS
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in REGS)


@pytest.mark.parametrize("hd,stages", [(64, 2), (128, 1), (256, 1)])
def test_shared_memory_and_stages(hd, stages):
    cfg = Sm100BwdConfig(head_dim=hd)
    assert cfg.num_stages == stages and cfg.smem_bytes() <= SMEM_LIMIT_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        Sm100BwdConfig(head_dim=128, num_stages=2)


def test_shared_xla_side_reads_it_like_the_hopper_config():
    """`kernels.call._backward` pads lse2 / delta and sizes dq_sem from tile_m and reads
    dq_flat / mods / ALiBi fields: the Blackwell config answers them."""
    from jaxflash.kernels.variants.bwd_launch import num_q_blocks, padded_len
    cfg = Sm100BwdConfig(head_dim=64, deterministic=True)
    assert padded_len(1000, cfg) == 1024 and num_q_blocks(1000, cfg) == 8
    assert (cfg.dq_flat, cfg.score_mod, cfg.mask_mod, cfg.aux, cfg.has_alibi) == (
        False, "", "", (), False)
    from jaxflash.kernels.variants.bwd import ALIBI_PARTS
    from jaxflash.kernels.variants.sm100_bwd_launch import sm100_bwd_launch
    launch = sm100_bwd_launch(cfg)
    assert len(launch.inputs) == 6 and len(launch.outputs) == 4  # + dq_sem
    assert launch.kernel.endswith(":FlashBwdSm100")
    # ALiBi: slopes in, per-compute-warp d(slope) partials out (8 compute warps), before dq_sem
    launch = sm100_bwd_launch(dataclasses.replace(cfg, has_alibi=True))
    assert launch.inputs[-1].shape == (1, None)
    assert launch.outputs[3].shape[-1] == ALIBI_PARTS == 8 and len(launch.outputs) == 5


def test_head_dim_256_launches_both_passes():
    """The launch side runs both passes with the same inputs: "dv" writes dv only, "dkdq" dq_acc,
    dk and the ALiBi partials / semaphores; the semaphores count 64-query blocks there, and lse2
    is padded for both passes' tiles."""
    from jaxflash.kernels import call
    from jaxflash.kernels.variants.bwd_launch import num_q_blocks, padded_len
    from jaxflash.kernels.variants.sm100_bwd_launch import (output_names, pass_launches,
                                                             sm100_bwd_launch)
    cfg = Sm100BwdConfig(head_dim=256, has_alibi=True, deterministic=True)
    launches = pass_launches(sm100_bwd_launch(cfg))
    assert [l.config.bwd_pass for l in launches] == ["dv", "dkdq"]
    assert [output_names(l.config) for l in launches] == [
        ("dv",), ("dq_acc", "dk", "alibi_parts", "dq_sem")]
    assert [len(l.outputs) for l in launches] == [1, 4]
    assert launches[0].inputs == launches[1].inputs and len(launches[0].inputs) == 7
    assert launches[0].key != launches[1].key
    assert num_q_blocks(1000, launches[1].config) == 16
    assert padded_len(1000, launches[0].config) % 64 == 0
    assert call._backward_passes(launches[1]) == launches
    one = sm100_bwd_launch(Sm100BwdConfig(head_dim=128, deterministic=True))
    assert call._backward_passes(one) == (one,)
    assert call._output_names(one.config) == ("dq_acc", "dk", "dv", "dq_sem")
