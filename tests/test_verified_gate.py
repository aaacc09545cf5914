"""The gate that keeps kernel variants not yet checked on a GPU out of dispatch
(`jaxflash.kernels.policy.verified`): refused with a reason naming the features, admitted with the
switch, and every variant the default dispatch picks today is verified."""
from __future__ import annotations

import dataclasses

import pytest

from jaxflash.kernels.policy import verified
from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.variants.fwd import FwdConfig


@dataclasses.dataclass(frozen=True)
class _Fake:
    key: str = "fake_variant"
    pending: tuple = ("a new mask",)


@pytest.fixture(autouse=True)
def _fake_rules(monkeypatch):
    """`_Fake` names its pending features through a rule, as the real config classes do."""
    monkeypatch.setitem(verified.RULES, "_Fake",
                        (("a new mask", lambda c: "a new mask" in c.pending),))


def test_unverified_refused_with_reason(monkeypatch):
    monkeypatch.delenv(verified.ENV, raising=False)
    with pytest.raises(NotImplementedError, match=r"fake_variant uses a new mask.*"
                                                  + verified.ENV):
        verified.require_verified(_Fake(), "backward")


def test_switch_admits(monkeypatch):
    monkeypatch.setenv(verified.ENV, "1")
    verified.require_verified(_Fake(), "backward")
    monkeypatch.setenv(verified.ENV, "0")
    with pytest.raises(NotImplementedError):
        verified.require_verified(_Fake(), "backward")


def test_verified_passes(monkeypatch):
    monkeypatch.delenv(verified.ENV, raising=False)
    verified.require_verified(_Fake(pending=()), "forward")


def test_every_variant_dispatch_picks_is_verified():
    """Every forward and backward variant dispatch picks, on the anchor grid and with each
    feature, passed its GPU checks: nothing it picks is pending in `verified.RULES` (a feature
    added later is listed there until a GPU run checks it)."""
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import backward_config, forward_config
    problems = []
    for d in (64, 96, 128, 192, 256):
        for s_ in (128, 1024, 4096, 16384):
            for causal in (False, True):
                problems.append(Problem(batch=2, q_len=s_, kv_len=s_, num_heads=4,
                                        num_kv_heads=2, head_dim=d, head_dim_v=d,
                                        dtype="bfloat16",
                                        statics=AttentionStatics(d ** -0.5, is_causal=causal)))
    base = problems[:]
    for p in base:
        for st in (dict(window=(100, 0)), dict(softcap=30.0), dict(deterministic=True)):
            problems.append(dataclasses.replace(
                p, statics=dataclasses.replace(p.statics, **st)))
        for flags in (dict(has_q_seqlen=True, has_kv_seqlen=True), dict(has_alibi=True),
                      dict(has_segments=True), dict(dtype="float16")):
            problems.append(dataclasses.replace(p, **flags))
    seen = 0
    for p in problems:
        for choose in (forward_config, backward_config):
            try:
                cfg = choose(p)
            except ValueError:
                continue  # refused (e.g. ALiBi at hd 128 backward): not dispatched to CuTe
            assert verified.pending(cfg) == (), cfg.key
            seen += 1
    assert seen > 500

def test_forward_192_rows_checked_and_picked():
    """tile_m 192 (three consumer warpgroups) passed its GPU checks and is what hdim 64 dense /
    causal calls get from 2k keys (dense 1k: 256 rows; causal 1k: two CTAs per SM); its check
    cases and bench column stay."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import schedule_for
    for cfg in (FwdConfig(head_dim=64, tile_m=192), FwdConfig(head_dim=64, tile_m=192,
                                                              is_causal=True, dtype="float16")):
        assert verified.pending(cfg) == ()
    for S in (1024, 4096, 16384):
        for causal in (False, True):
            cfg = FwdConfig(head_dim=64, is_causal=causal, **schedule_for(64, S, causal))
            want = (64 if causal else 256) if S == 1024 else 192  # (dense 1k: 256 rows)
            assert cfg.tile_m == want
    names = [n for n, kw, _ in devrun.CHECKS if kw.get("tile_m") == 192]
    assert len(names) >= 6 and any("causal" in n for n in names)
    assert devrun.VARIANTS["m192_ps"] == dict(head_dim=64, tile_m=192, persistent=True)


def test_backward_tile_m_128_checked_and_benched():
    """tile_m 128 passed its 16 GPU checks and is hd 64's default; the bench
    keeps timing the 64-query step (and the deterministic mode at 128) beside it."""
    from devtools import bwd_devrun
    cfg = BwdConfig(head_dim=64, tile_m=128)
    assert verified.pending(cfg) == ()
    names = [n for n, kw, _ in bwd_devrun.CHECKS if kw.get("tile_m") == 128]
    assert len(names) >= 10 and any("deterministic" in n for n in names)
    assert bwd_devrun.BENCH_VARIANTS[64]["m64"] == dict(tile_m=64)
    fwd, bwd = bwd_devrun._configs(dict(head_dim=64, tile_m=128))
    assert bwd.tile_m == 128 and fwd == FwdConfig(head_dim=64)


def test_forward_tile_pipe_checked():
    """The persistent forward's tile pipe passed its device checks: not gated;
    its check cases (every head dim, causal, fp16 lengths) and bench column stay."""
    from devtools import devrun
    cfg = FwdConfig(head_dim=128, persistent=True, tile_pipe=True)
    assert verified.pending(cfg) == ()
    assert verified.pending(FwdConfig(head_dim=128, persistent=True)) == ()
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("tile_pipe")]
    assert {kw["head_dim"] for kw in cases} >= {64, 128, 256}
    assert any(kw.get("is_causal") for kw in cases)
    assert any(kw.get("dtype") == "float16" and kw.get("has_q_seqlen") for kw in cases)
    assert devrun.VARIANTS["persist2"] == dict(persistent=True, tile_pipe=True)


def test_wide_backward_refuses_segments():
    ok, why = BwdConfig.check.__get__(BwdConfig(head_dim=256))()
    assert ok
    with pytest.raises(ValueError, match="segment ids at head_dim 256"):
        BwdConfig(head_dim=256, has_segments=True)


def test_check_cases_compile_the_features_their_inputs_use():
    """Each GPU check case's config has exactly the features its inputs exercise: a variant
    compiled without a feature ignores that input, and the case would test a call dispatch
    never makes (one did: key lengths given, has_kv_seqlen missing)."""
    from devtools import bwd_devrun
    from devtools import devrun
    for name, kw, (*_, ex) in devrun.CHECKS:
        assert devrun.case_mismatch(name, FwdConfig(**kw), ex) == ""
    for name, kw, (*_, ex) in bwd_devrun.CHECKS + bwd_devrun.DETERMINISM:
        assert devrun.case_mismatch(name, bwd_devrun._configs(kw)[1], ex) == ""
    bad = devrun.case_mismatch("x", BwdConfig(head_dim=96, has_alibi=True),
                               {"alibi": 1, "kv_seqlen": [3, 0]})
    assert "kv_seqlen" in bad and "has_kv_seqlen=False" in bad
    assert "has_alibi=True" in devrun.case_mismatch("y", BwdConfig(head_dim=64, has_alibi=True), {})


def test_backward_cudnn_comparisons_only_where_cudnn_computes_the_same_function():
    """The backward checks compare with cuDNN's gradients only on cases that opt in; jax.nn's
    cuDNN path has no softcap, ALiBi or segment ids, so such a case's ratio would be noise."""
    from devtools import bwd_devrun
    for name, kw, (*_, ex) in bwd_devrun.CHECKS:
        if ex.get("cudnn"):
            assert not (kw.get("has_softcap") or kw.get("has_alibi") or kw.get("has_segments")), name


def test_forward_192_rows_persistent_checked_and_picked():
    """192-row tiles on the persistent loop passed 6 GPU checks and the sanitizer: not gated,
    and what hd 64 plain calls get where the key loop is short (S <= 1k; causal S <= 4k);
    devrun keeps its check cases (dense, causal, T < S, lengths, window + softcap, tile pipe)
    and bench column."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import schedule_for
    assert verified.pending(FwdConfig(head_dim=64, tile_m=192, persistent=True)) == ()
    assert schedule_for(64, 1024, False, softcap=True) == dict(tile_m=192, persistent=True)
    assert schedule_for(64, 1024, False)["tile_m"] == 256
    assert schedule_for(64, 1024, True) == dict(tile_m=64, ctas_per_sm=2, tile_n=64,
                                                persistent=True, tile_pipe=True,
                                                tile_order="pairs", mask_select=True)
    assert schedule_for(64, 1024, True, softcap=True) == dict(tile_m=192, persistent=True)
    assert schedule_for(64, 4096, True) == dict(tile_m=192, persistent=True)
    assert schedule_for(64, 4096, False) == dict(tile_m=192, mask_skip=True)
    assert schedule_for(64, 16384, True) == dict(tile_m=192)
    assert schedule_for(64, 1024, True, plain=False) == {}
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("tile_m") == 192 and kw.get("persistent")]
    assert len(cases) >= 6 and any(kw.get("has_kv_seqlen") for kw in cases)
    assert any(kw.get("is_causal") for kw in cases) and any(not kw.get("is_causal") for kw in cases)
    assert devrun.VARIANTS["m192_ps"] == dict(head_dim=64, tile_m=192, persistent=True)


def test_gate_rules_live_outside_the_hashed_sources():
    """Clearing a feature edits `verified.RULES`, which no kernel or config module imports, so
    it changes no artifact's key (the same holds for `choose.py`)."""
    from jaxflash.ffi.variant import source_files
    files = {m for m, _ in source_files("jaxflash.kernels.sm90.fwd:FlashFwdSm90",
                                        "jaxflash.kernels.variants.fwd:FwdConfig")}
    files |= {m for m, _ in source_files("jaxflash.kernels.sm90.bwd_wide:FlashBwdSm90Wide",
                                         "jaxflash.kernels.variants.bwd:BwdConfig")}
    assert "jaxflash.kernels.variants.fwd" in files and "jaxflash.kernels.sm90.bwd" in files
    assert "jaxflash.kernels.policy.verified" not in files and "jaxflash.kernels.policy.choose" not in files
    assert not hasattr(FwdConfig, "unverified") and not hasattr(BwdConfig, "unverified")


def test_forward_wg_epilogue_checked_and_picked():
    """The per-warpgroup epilogue passed 8 float64 checks (bitwise repeats included), memcheck
    and racecheck on the H200: not gated, picked where it was faster in both runs (hd 128 at
    S <= 1k, but causal without softcap, which runs two CTAs per SM), only with persistent +
    its own O buffer."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import schedule_for
    cfg = FwdConfig(head_dim=128, persistent=True, tile_pipe=True, wg_epilogue=True)
    assert verified.pending(cfg) == () and cfg.key.endswith("tpwe_dense")
    assert schedule_for(128, 1024, False)["wg_epilogue"]
    assert "wg_epilogue" not in schedule_for(128, 1024, True)  # two CTAs per SM there
    assert schedule_for(128, 1024, True, softcap=True)["wg_epilogue"]
    assert "wg_epilogue" not in schedule_for(128, 4096, False)
    assert "wg_epilogue" not in schedule_for(64, 1024, False)
    with pytest.raises(ValueError, match="wg_epilogue needs persistent"):
        FwdConfig(head_dim=128, wg_epilogue=True)
    with pytest.raises(ValueError, match="wg_epilogue needs persistent"):
        FwdConfig(head_dim=256, persistent=True, wg_epilogue=True)  # O shares Q's buffer
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("wg_epilogue")]
    assert len(cases) >= 5 and {kw["head_dim"] for kw in cases} == {64, 128}
    assert any(kw.get("tile_m") == 192 for kw in cases)


def test_forward_lazy_rescale_exact_checked_picked_on_long_keys():
    """The skipped O rescale (threshold 0: bitwise the results without it, checked on the
    H200 by `lazy_exact`) is not gated; dispatch picks it only where two benches of the pick
    with / without it said so (kv_len > 8k at hd 64 dense and hd 256, no softcap; never at
    hd 128, where it lost everywhere); its float64 check cases include inputs whose row max
    grows block after block (k_ramp)."""
    from devtools import devrun
    from devtools import lazy_exact
    from jaxflash.kernels.common import softmax
    from jaxflash.kernels.policy.choose import LAZY_MIN_KV_LEN, schedule_for
    assert softmax.LAZY_RESCALE_LOG2 == 0.0
    cfg = FwdConfig(head_dim=128, lazy_rescale=True)
    assert verified.pending(cfg) == () and "lz" in cfg.key
    picked = {(d, s_, c) for d in (64, 128, 256) for s_ in (1024, 4096, 8192, 16384)
              for c in (False, True) if schedule_for(d, s_, c).get("lazy_rescale")}
    assert picked == {(64, 16384, False), (256, 16384, False), (256, 16384, True)}
    assert LAZY_MIN_KV_LEN == 8192
    assert not schedule_for(256, 16384, True, softcap=True).get("lazy_rescale")
    assert schedule_for(64, 16384, False) == {"tile_m": 192, "lazy_rescale": True}
    assert "pick_lazy" in devrun.pick_columns(256, 16384, True)
    assert {c.lazy_rescale for c in lazy_exact.configs()} == {False, True}
    assert any("k_ramp" in ex for _, _, ex in lazy_exact.CASES)
    cases = [(kw, p) for _, kw, p in devrun.CHECKS if kw.get("lazy_rescale")]
    assert len(cases) >= 6 and sum(1 for _, p in cases if "k_ramp" in p[-1]) >= 3
    assert {kw["head_dim"] for kw, _ in cases} == {64, 128, 256}
    assert devrun.VARIANTS["lazy"] == dict(lazy_rescale=True)


def test_backward_dq_flat_checked_benched_and_picked():
    """dq_flat (the dQ tile in fragment order, one bulk reduce per step) passed its checks on
    the H200 and is picked wherever the step is 64 queries and on hd 64's
    128-query step without a mask, except with ALiBi, segment ids, or softcap at hd 128; its
    check cases cover both kernels (hd 96 / 128 / 192
    / 256), fp16, deterministic, and a bench column sits beside hd 128's and hd 256's
    defaults."""
    from devtools import bwd_devrun
    from jaxflash.kernels.policy.choose import use_dq_flat
    cfg = BwdConfig(head_dim=128, early_dv=True, dq_flat=True)
    assert cfg.check()[0] and verified.pending(cfg) == () and "_dqf" in cfg.key
    for masked in (False, True):
        assert use_dq_flat(128, False, False, False, masked)
        assert use_dq_flat(256, True, False, False, masked)
        assert use_dq_flat(96, True, False, False, masked)
        assert use_dq_flat(192, False, False, False, masked)
        assert use_dq_flat(64, True, False, False, masked)  # softcap: 64-query step at hd 64
        assert not use_dq_flat(128, True, False, False, masked)  # ptxas spills 24 B
        assert not use_dq_flat(96, False, True, False, masked)
        assert not use_dq_flat(128, False, False, True, masked)
    assert use_dq_flat(64, False, False, False, False)  # 128-query step, dense: picked
    assert not use_dq_flat(64, False, False, False, True)  # causal: slower there
    cases = [kw for _, kw, _ in bwd_devrun.CHECKS if kw.get("dq_flat")]
    assert {kw["head_dim"] for kw in cases} == {64, 96, 128, 192, 256} and len(cases) >= 18
    assert any(kw.get("deterministic") for kw in cases)
    assert any(kw.get("dq_flat") for _, kw, _ in bwd_devrun.DETERMINISM)
    assert bwd_devrun.BENCH_VARIANTS[128]["edv_dqf"] == dict(early_dv=True, dq_flat=True)
    assert bwd_devrun.BENCH_VARIANTS[256]["dqf"] == dict(dq_flat=True)


def test_forward_pairs_cleared_and_picked_where_measured():
    """tile_order "pairs" (persistent causal tiles two by two, tile m with tile nm - 1 - m)
    passed its GPU checks and is picked at causal hd 128 / 256 up to 4k (won both benches
    there; and with two CTAs per SM at hd 64 / 128 1k), not at 16k, hd 64 with 192 rows, dense,
    softcap or masks it was not measured with; its check cases cover hd 64 (192 rows) / 96 /
    128 / 256, odd and even tile
    counts, T < S and T > S, window with lengths, fp16, and a "pick_pairs" bench column sits
    beside the pick at every causal grid point."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import schedule_for
    cfg = FwdConfig(head_dim=128, is_causal=True, persistent=True, tile_pipe=True,
                    tile_order="pairs")
    assert verified.pending(cfg) == ()
    for d in (64, 128, 256):
        for s_ in (1024, 4096, 16384):
            for c in (False, True):
                picked = schedule_for(d, s_, c).get("tile_order", "auto") == "pairs"
                want = d in (128, 256) and s_ <= 4096 or d == 64 and s_ <= 1024
                assert picked == (c and want), (d, s_, c)
                assert schedule_for(d, s_, c, softcap=True).get("tile_order") != "pairs"
                col = devrun.pick_columns(d, s_, c)["pick_pairs"]
                assert (col is None) == (not c) and (col is None or col.tile_order == "pairs")
    assert schedule_for(128, 4096, True, plain=False) == {}  # windows etc.: the default
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("tile_order") == "pairs"]
    assert {kw["head_dim"] for kw in cases} == {64, 96, 128, 256} and len(cases) >= 10
    assert any(kw.get("tile_m") == 192 for kw in cases)
    assert any(kw.get("has_window") and kw.get("has_q_seqlen") for kw in cases)


def test_backward_tail_lpt_cleared_and_picked_on_plain_causal():
    """tail_lpt (the last heads' backward CTAs launched key-block-major) passed its GPU checks
    and is picked on every plain causal backward (faster in both benches at every
    causal point), with dq_flat at hd 64 (which pays there only with it); never dense,
    deterministic, windowed, softcapped; its check cases cover hd 64 / 128 / 256,
    deterministic, lengths with empty rows, fp16, T < S and T > S, and bench columns sit beside
    each head dim's default at the causal points (1k included)."""
    import dataclasses
    from devtools import bwd_devrun
    from jaxflash.kernels.policy.choose import backward_config
    from devtools.devrun import grid_problem
    cfg = BwdConfig(head_dim=128, is_causal=True, early_dv=True, dq_flat=True, tail_lpt=True)
    assert verified.pending(cfg) == () and "_tl" in cfg.key
    with pytest.raises(ValueError, match="tail_lpt"):
        BwdConfig(head_dim=128, tail_lpt=True)
    for d in (64, 128, 256):
        for s_ in (1024, 4096, 16384):
            for c in (False, True):
                p = grid_problem(d, s_, c)
                b = backward_config(p)
                assert b.tail_lpt == c and b.dq_flat, (d, s_, c)
                for st in (dict(deterministic=True), dict(softcap=30.0)):
                    q = dataclasses.replace(p, statics=dataclasses.replace(p.statics, **st))
                    assert not backward_config(q).tail_lpt
    cases = [kw for _, kw, _ in bwd_devrun.CHECKS if kw.get("tail_lpt")]
    assert {kw["head_dim"] for kw in cases} == {64, 128, 256} and len(cases) >= 8
    assert any(kw.get("deterministic") for kw in cases)
    assert bwd_devrun.BENCH_VARIANTS[128]["edv_dqf_tl"]["tail_lpt"]
    assert {(128, 1024, True), (256, 1024, True), (64, 1024, True)} <= bwd_devrun.VARIANT_POINTS


def test_forward_two_ctas_per_sm_cleared_and_picked_where_measured():
    """64-row tiles at two CTAs per SM passed their float64 checks and the sanitizers on the
    H200: cleared, and picked where two benches measured a gain,
    causal S <= 1k at hd 64 / 128 without softcap (64-key stages, paired tiles); tile_m 64 and
    ctas_per_sm 2 come together; shared memory is held to half the SM's; check cases cover
    hd 64 / 96 / 128, persistent or not, pairs, window with lengths, softcap, fp16."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import forward_config
    from devtools.devrun import grid_problem
    cfg = FwdConfig(head_dim=128, tile_m=64, ctas_per_sm=2, num_stages=1, persistent=True,
                    tile_pipe=True)
    assert verified.pending(cfg) == () and "_c2" in cfg.key
    assert cfg.smem_bytes() <= cfg.smem_limit == 228 * 1024 // 2 - 1024
    for bad in (dict(tile_m=64), dict(ctas_per_sm=2), dict(tile_m=64, ctas_per_sm=3)):
        with pytest.raises(ValueError, match="ctas_per_sm"):
            FwdConfig(head_dim=128, **bad)
    # 128-row tiles at two CTAs per SM (hd 64) hung on the H200: the consumers' setmaxnreg.inc
    # wants more registers than the producer's decrease frees (`test_kernels_compile`,
    # `test_setmaxnreg_raises_fit_the_registers_the_producer_frees`): refused as a config
    with pytest.raises(ValueError, match="ctas_per_sm"):
        FwdConfig(head_dim=64, tile_m=128, ctas_per_sm=2, tile_n=64, persistent=True,
                  tile_pipe=True)
    with pytest.raises(ValueError, match="head_dim"):  # ptxas C7602 under 128 registers
        FwdConfig(head_dim=256, tile_m=64, ctas_per_sm=2, num_stages=1)
    with pytest.raises(ValueError, match="shared memory"):  # two 128-key stages: too big
        FwdConfig(head_dim=128, tile_m=64, ctas_per_sm=2)
    picked = {(d, s_, c) for d in (64, 128, 256) for s_ in (1024, 4096, 16384) for c in (0, 1)
              if forward_config(grid_problem(d, s_, c)).ctas_per_sm == 2}
    assert picked == {(64, 1024, 1), (128, 1024, 1)}
    for d in (64, 128):
        pick = forward_config(grid_problem(d, 1024, 1))
        assert (pick.tile_m, pick.tile_n, pick.tile_order) == (64, 64, "pairs")
        assert verified.pending(pick) == ()
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("ctas_per_sm") == 2]
    assert {kw["head_dim"] for kw in cases} == {64, 96, 128} and len(cases) >= 9
    assert any(kw.get("tile_order") == "pairs" for kw in cases)
    assert any(kw.get("tile_n") == 64 for kw in cases)
    assert any(not kw.get("persistent") for kw in cases)
    assert devrun._variant(128, False, devrun.VARIANTS["m64c2_s1"]).ctas_per_sm == 2
    assert devrun._variant(128, True, devrun.VARIANTS["m64c2_s1_pairs"]).tile_order == "pairs"


def test_forward_mask_skip_cleared_picked_where_measured_and_benched():
    """`mask_skip` (checked on the H200) is cleared and named in the key; dispatch
    picks it at the dense points where two interleaved benches showed it paying (hd 128 every
    length, hd 64 4k), not at causal ones, softcap or non-plain calls; the bench times the pick
    with it flipped at every dense grid point; check cases cover key lengths on and off the
    tile, per-batch lengths with an empty one, T > S, the dense picks of hd 64 / 128 / 256 and
    the two-CTA tile."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import forward_config, schedule_for
    from devtools.devrun import grid_problem
    cfg = FwdConfig(head_dim=128, persistent=True, tile_pipe=True, mask_skip=True)
    assert verified.pending(cfg) == () and cfg.key.endswith("_msk_dense")
    assert "_msk" not in FwdConfig(head_dim=128).key
    picked = {(d, s_) for d in (64, 128, 256) for s_ in (1024, 4096, 16384)
              if forward_config(grid_problem(d, s_, 0)).mask_skip}
    # (hd 64 1k: with the 256-row tiles picked there)
    assert picked == {(128, 1024), (128, 4096), (128, 16384), (64, 4096), (64, 1024)}
    for d in (64, 128, 256):
        for s_ in (1024, 4096, 16384):
            assert not forward_config(grid_problem(d, s_, 1)).mask_skip
            for c in (0, 1):
                pick = forward_config(grid_problem(d, s_, c))
                col = devrun.pick_columns(d, s_, c)["pick_msk"]
                assert (col is None) == bool(c)
                assert col is None or col.mask_skip != pick.mask_skip
    assert "mask_skip" not in schedule_for(128, 1024, False, softcap=True)
    assert schedule_for(128, 1024, False, plain=False) == {}
    cases = [(kw, p) for _, kw, p in devrun.CHECKS if kw.get("mask_skip")]
    assert {kw["head_dim"] for kw, _ in cases} == {64, 128, 256} and len(cases) >= 6
    assert any(p[2] % 128 == 0 for _, p in cases) and any(p[2] % 128 for _, p in cases)
    assert any(0 in p[-1].get("kv_seqlen", ()) for _, p in cases)
    assert any(kw.get("ctas_per_sm") == 2 for kw, _ in cases)


def test_forward_mask_select_cleared_picked_at_causal_and_benched():
    """`mask_select` (checked on the H200) is cleared and named in the key, refused where it
    is implied (192-row tiles); dispatch picks it for every plain causal call
    whose tile is not 192 rows at the head dims whose checks ran (hd 192's too), nowhere
    else; the bench times the pick with it flipped at every causal grid point; check cases
    cover the causal picks, T < S, softcap, a window with lengths (empty rows), a dense key
    tail, hd 64 / 96 / 128 / 192 / 256."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import forward_config, schedule_for
    from devtools.devrun import grid_problem
    cfg = FwdConfig(head_dim=128, is_causal=True, mask_select=True)
    assert verified.pending(cfg) == () and cfg.key.endswith("_sel_causal")
    with pytest.raises(ValueError, match="mask_select"):
        FwdConfig(head_dim=64, tile_m=192, is_causal=True, mask_select=True)
    for d in (64, 128, 256):
        for s_ in (1024, 4096, 16384):
            for c in (0, 1):
                pick = forward_config(grid_problem(d, s_, c))
                assert pick.mask_select == bool(c and pick.tile_m != 192)
                col = devrun.pick_columns(d, s_, c)["pick_sel"]
                assert (col is None) == (not c or pick.tile_m == 192)
                assert col is None or col.mask_select != pick.mask_select
    assert schedule_for(128, 4096, True, softcap=True)["mask_select"]
    assert schedule_for(128, 4096, True, plain=False) == {}
    cases = [kw for _, kw, _ in devrun.CHECKS if kw.get("mask_select")]
    assert {kw["head_dim"] for kw in cases} >= {64, 96, 128, 192, 256} and len(cases) >= 10
    assert any(kw.get("has_window") and kw.get("has_kv_seqlen") for kw in cases)
    assert any(not kw.get("is_causal") for kw in cases)
    assert any(kw.get("ctas_per_sm") == 2 for kw in cases)
    # hd 192's case passed on the H200: picked there too
    assert schedule_for(192, 4096, True)["mask_select"]
    assert schedule_for(96, 4096, True) == {"mask_select": True}
    # the masked calls off the grid: timed with and without it before dispatch gives it them
    from devtools.feat_bench import FEAT_BENCH, columns, feat_configs
    feats = feat_configs()
    assert {c.key for c in feats} <= {c.key for c in devrun.bench_configs()}
    assert all(c.has_window or c.has_kv_seqlen for c in feats)
    for _, kw, ex in FEAT_BENCH:
        cols = columns(kw, ex)
        # dispatch gives these calls the plain call's schedule (measured with feat_bench)
        d = cols["dispatched"]
        assert d == FwdConfig(**kw, **schedule_for(d.head_dim, 4096, d.is_causal))
        assert d.persistent and cols["default"] == FwdConfig(**kw)
        assert cols["flipped"] is None or cols["flipped"].mask_select != d.mask_select


def test_forward_masked_calls_take_the_plain_schedule():
    """Windows and key lengths get the plain call's schedule (feat_bench, H200);
    query lengths, ALiBi and segment ids keep the default; the float64 cases hold each picked
    schedule together with a window or lengths."""
    from jaxflash._types import AttentionStatics, Problem
    from devtools import devrun
    from jaxflash.kernels.policy.choose import forward_config, schedule_for

    def pick(D, S, causal, window=None, **flags):
        st = AttentionStatics(scale=D ** -0.5, is_causal=causal, window=window)
        return forward_config(Problem(batch=2, q_len=S, kv_len=S, num_heads=8, num_kv_heads=8,
                                      head_dim=D, head_dim_v=D, dtype="bfloat16", statics=st,
                                      **flags))
    for D, S, c in [(128, 4096, True), (64, 1024, True), (256, 16384, False), (128, 1024, 0)]:
        plain = schedule_for(D, S, bool(c))
        for flags, window in (({"has_kv_seqlen": True}, None), ({}, (100, 0))):
            got = pick(D, S, bool(c), window, **flags)
            assert {k: getattr(got, k) for k in plain} == plain, (D, S, c, flags, window)
        for flags in ({"has_q_seqlen": True}, {"has_alibi": True}, {"has_segments": True}):
            got = pick(D, S, bool(c), **flags)
            assert not got.persistent and got.tile_m == FwdConfig(head_dim=D).tile_m
    cases = [kw for _, kw, _ in devrun.CHECKS]
    for sched in ({"persistent": True, "mask_skip": True}, {"tile_order": "pairs"},
                  {"ctas_per_sm": 2, "tile_order": "pairs"}, {"tile_m": 192, "persistent": True}):
        for feat in ("has_window", "has_kv_seqlen"):
            assert any(all(kw.get(k) == v for k, v in sched.items()) and kw.get(feat)
                       for kw in cases), (sched, feat)


def _picked_where(flag: str, where) -> None:
    """At each point (D, S, causal) of the anchor grid (and D=192), dispatch's backward config
    has ``flag`` set exactly where ``where(D, S, causal)`` is true."""
    from jaxflash.kernels.policy.choose import backward_config
    from devtools.devrun import grid_problem
    for d in (64, 128, 192, 256):
        for s_ in (1024, 4096, 16384):
            for c in (0, 1):
                got = bool(getattr(backward_config(grid_problem(d, s_, c)), flag))
                assert got == bool(where(d, s_, c)), (flag, d, s_, c)


def test_backward_q_multicast_cleared_keyed_refused_picked_at_dense_hd256_from_4k():
    """q_multicast (key-block pairs sharing Q / dO loads by TMA multicast) passed its H200
    checks: cleared, keyed, refused where the pair's CTAs would walk different
    query blocks, and picked at plain dense hd 256 from 4k keys only (where it was measured
    faster); its check cases and bench columns stay."""
    from devtools import bwd_devrun
    from jaxflash.kernels.policy.choose import backward_config
    from devtools.devrun import grid_problem
    cfg = BwdConfig(head_dim=256, dq_flat=True, q_multicast=True)
    base = BwdConfig(head_dim=256, dq_flat=True)
    assert "_qmc" in cfg.key and cfg.key != base.key
    assert cfg.smem_bytes() == base.smem_bytes() and cfg.num_stages == base.num_stages
    assert verified.pending(cfg) == () and verified.pending(base) == ()
    assert "_tl" in BwdConfig(head_dim=256, is_causal=True, tail_lpt=True, q_multicast=True).key
    for bad in (dict(has_window=True), dict(deterministic=True), dict(has_segments=True,
                                                                        head_dim=128)):
        with pytest.raises(ValueError, match="q_multicast"):
            BwdConfig(**{"head_dim": 256, "q_multicast": True, **bad})
    _picked_where("q_multicast", lambda d, s_, c: d == 256 and s_ >= 4096 and not c)
    assert backward_config(grid_problem(256, 4096, 0)).dq_flat  # the pair's dQ path
    kws = [kw for _, kw, _ in bwd_devrun.CHECKS if kw.get("q_multicast")]
    assert len(kws) >= 8 and {kw["head_dim"] for kw in kws} == {128, 192, 256}
    assert any(kw.get("is_causal") for kw in kws) and any(kw.get("has_kv_seqlen") for kw in kws)
    assert any(kw.get("tail_lpt") for kw in kws)
    assert {"dqf_qmc", "dqf_tl_qmc"} <= set(bwd_devrun.BENCH_VARIANTS[256])
    assert {"edv_dqf_qmc", "edv_dqf_tl_qmc"} <= set(bwd_devrun.BENCH_VARIANTS[128])


def test_forward_256_row_tiles_cleared_and_picked_at_dense_hd64_up_to_2k():
    """256-row tiles (hd 64, four consumer warpgroups) passed their H200 checks and are
    picked, with mask_skip, for dense hd 64 calls up to 2k keys (no softcap) and
    nowhere else on the grid; other head dims, wider key tiles and softcap are refused as
    configs; check cases cover dense (odd lengths, 1k against cuDNN with repeats, T > S with
    mask_skip, shorter than a tile), causal pairs and T < S, a window with lengths, fp16."""
    from devtools import devrun
    from jaxflash.kernels.policy.choose import forward_config, schedule_for
    from devtools.devrun import grid_problem
    cfg = FwdConfig(head_dim=64, tile_m=256, tile_n=64, persistent=True, tile_pipe=True)
    assert verified.pending(cfg) == ()
    assert cfg.num_mma_warpgroups == 4 and "_t256x64" in cfg.key
    for bad in (dict(head_dim=128, tile_n=64), dict(head_dim=64, tile_n=128),
                dict(head_dim=64, tile_n=64, has_softcap=True)):
        with pytest.raises(ValueError, match="tile_m 256"):
            FwdConfig(tile_m=256, **bad)
    for d in (64, 128, 256):
        for s_ in (1024, 4096, 16384):
            for c in (0, 1):
                got = forward_config(grid_problem(d, s_, c))
                assert (got.tile_m == 256) == (d == 64 and s_ == 1024 and not c), (d, s_, c)
    got = forward_config(grid_problem(64, 1024, 0))
    assert (got.tile_n, got.persistent, got.tile_pipe, got.mask_skip) == (64, True, True, True)
    assert verified.pending(got) == ()
    for kv in (100, 1000, 1024, 2048):
        assert schedule_for(64, kv, False)["tile_m"] == 256
    assert schedule_for(64, 2049, False)["tile_m"] == 192
    assert schedule_for(64, 1024, False, softcap=True)["tile_m"] == 192
    cases = [(n, kw, p) for n, kw, p in devrun.CHECKS if kw.get("tile_m") == 256]
    assert len(cases) >= 7 and all(kw["head_dim"] == 64 for _, kw, _ in cases)
    kws = [kw for _, kw, _ in cases]
    assert any(kw.get("tile_order") == "pairs" for kw in kws)
    assert any(kw.get("has_window") and kw.get("has_kv_seqlen") for kw in kws)
    assert any(kw.get("mask_skip") for kw in kws) and any(not kw.get("persistent") for kw in kws)
    assert any(p[1] < 256 for _, _, p in cases) and any(p[-1].get("cudnn") for _, _, p in cases)
    assert devrun._variant(64, False, devrun.VARIANTS["m256"]) is not None
    assert devrun._variant(64, True, devrun.VARIANTS["m256_pairs"]).mask_select
    assert {(64, 1024, False), (64, 2048, False)} <= devrun.VARIANT_POINTS


def test_short_window_takes_the_short_loop_schedule():
    """hd 128 windows of <= 2048 keys over > 4k keys take `SHORT_WINDOW_SCHEDULE` (measured
    there); shorter keys, longer windows keep the plain pick (GPU check:
    tests/kernels/test_short_window_gpu.py)."""
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.kernels.policy.choose import SHORT_WINDOW_SCHEDULE, forward_config
    from tests.kernels.test_short_window_gpu import CASES

    def problem(T, S, N, K, window, causal, softcap=None):
        st = AttentionStatics(scale=128 ** -0.5, is_causal=causal, window=window,
                              softcap=softcap)
        return Problem(batch=1, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, head_dim=128,
                       head_dim_v=128, dtype="bfloat16", statics=st)
    for case in CASES:
        cfg = forward_config(problem(*case))
        assert all(getattr(cfg, k) == v for k, v in SHORT_WINDOW_SCHEDULE.items()), cfg.key
    assert not forward_config(problem(4096, 4096, 4, 4, (1024, 0), True)).wg_epilogue
    assert not forward_config(problem(8192, 8192, 4, 4, (4096, 0), True)).tile_pipe
    assert not forward_config(problem(8192, 8192, 4, 4, (1024, 0), True, 30.0)).wg_epilogue


def test_causal_short_window_runs_as_the_window_alone():
    """is_causal with a short window (left, right >= 0) is the window (left, 0) alone: in the
    short-window regime the plan takes that variant (measured faster), and the launches'
    window scalars clip the right bound under the causal flag, so the causal variant and the
    window-alone one read the same bounds; elsewhere the statics stay as given."""
    from jaxflash._types import AttentionStatics, Problem
    from jaxflash.backends.cute import CuteBackend
    from jaxflash.kernels.policy.choose import forward_config, window_only
    from jaxflash.kernels.variants.fwd_launch import fwd_scalars

    def statics(window, causal):
        return AttentionStatics(scale=128 ** -0.5, is_causal=causal, window=window)

    def problem(S, st):
        return Problem(batch=1, q_len=S, kv_len=S, num_heads=4, num_kv_heads=2, head_dim=128,
                       head_dim_v=128, dtype="bfloat16", statics=st, platform="cuda")
    alone = forward_config(problem(16384, statics((1024, 0), False)))
    for right in (0, 40):
        st = statics((1024, right), True)
        assert window_only(st, 128, 16384) == statics((1024, 0), False)
        assert fwd_scalars(st)[1] == (1024, 0)
        assert forward_config(problem(16384, window_only(st, 128, 16384))).key == alone.key
        assert CuteBackend().plan(problem(16384, st)).fwd.config.key == alone.key
    assert fwd_scalars(statics((1024, 40), False))[1] == (1024, 40)
    for st, S in ((statics((1024, 0), True), 4096), (statics((4096, 0), True), 16384),
                  (statics((1024, -1), True), 16384)):
        assert window_only(st, 128, S) is st


@pytest.mark.parametrize("value,on", [("false", False), ("off", False), ("0", False),
                                      ("", False), ("1", True), ("true", True)])
def test_unverified_switch_reads_as_written(monkeypatch, value, on):
    """JAXFLASH_CUTE_UNVERIFIED=false (or off, 0) keeps the gate closed."""
    from jaxflash.kernels.policy import verified
    monkeypatch.setenv(verified.ENV, value)
    assert verified.allowed() is on
