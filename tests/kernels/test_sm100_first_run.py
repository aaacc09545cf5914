"""The Blackwell first-run kit (`devtools.blackwell_first_run`) off Blackwell: it refuses cleanly
(exit status 2, ``verdict.json`` with ``"status": "not_blackwell"`` and the device it found,
nothing run) on the CPU and on a Hopper GPU; its verdict rules (`devtools.blackwell_verdict`)
turn check results into the exact `RULES` change, whose source evaluates to the right gate.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devtools import blackwell_first_run as kit
from devtools import blackwell_verdict as V

pytestmark = pytest.mark.cpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_refuses_on_the_cpu_as_a_command(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "devtools.blackwell_first_run", "--out",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == kit.NOT_BLACKWELL, r.stderr[-2000:]
    assert "not a Blackwell GPU" in r.stderr and "Traceback" not in r.stderr
    v = json.load(open(tmp_path / "verdict.json"))
    assert v["status"] == "not_blackwell" and v["clear_gate"] is None
    assert v["device"]["platform"] == "cpu"
    assert sorted(os.listdir(tmp_path)) == ["verdict.json"]  # nothing else ran


def test_refuses_on_hopper(tmp_path, monkeypatch):
    monkeypatch.setattr(kit, "device_info", lambda: {"platform": "gpu", "kind": "NVIDIA H200",
                                                     "compute_capability": "9.0"})
    ran = []
    monkeypatch.setattr(kit, "check", lambda *a, **k: ran.append("check"))
    assert kit.main(["--out", str(tmp_path)]) == kit.NOT_BLACKWELL
    v = json.load(open(tmp_path / "verdict.json"))
    assert v["status"] == "not_blackwell" and "compute capability 9.0" in v["message"]
    assert "NVIDIA H200" in v["message"] and not ran
    assert kit.main(["check", "--out", str(tmp_path / "c")]) == kit.NOT_BLACKWELL
    # only 10.0 is this kit's: B300 (10.3) is another target (sm_103a, no kernel)
    assert not kit.is_blackwell({"platform": "gpu", "compute_capability": "10.3"})
    assert kit.is_blackwell({"platform": "gpu", "compute_capability": "10.0"})


def test_cases_cover_every_gated_feature():
    names = [c[0] for c in kit.CASES]
    assert len(names) == len(set(names))
    assert set(kit.SANITIZER_CASES) <= set(names)
    for cls, feats in V.FEATURES.items():
        covered = {f for c in kit.CASES if c[1] == cls for f in c[2]} | {"base"}
        covered |= {f for _, c, f in V.TEST_FEATURES if c == cls}
        assert covered == set(feats), (cls, set(feats) ^ covered)
    for _, cls, feats, shape, ex in kit.CASES:
        assert set(feats) <= set(V.FEATURES[cls])
        assert ("fp8" in ex) == (cls == "Sm100Fp8FwdConfig")


def _rows(fail=()):
    return [{"name": n, "cls": cls, "features": list(f), "ok": n not in fail}
            for n, cls, f, _, _ in kit.CASES]


CLEAN = {"memcheck": {"clean": True}, "racecheck": {"clean": True}}
TESTS = {"tests/kernels/test_sm100_gpu.py::test_a": "passed",
         "tests/kernels/test_sm100_fp8_gpu.py::test_b": "passed",
         "tests.kernels.test_sm100_2cta_gpu::test_p": "passed"}


def _gate(rule_src: str):
    """The RULES entry a verdict proposes, evaluated: {class: ((name, predicate), ...)}."""
    return eval("{" + rule_src + "}")


def test_verdict_clears_everything_that_passed():
    v = V.verdict({"platform": "gpu"}, _rows(), TESTS, CLEAN)
    assert v["status"] == "pass"
    assert v["clear_gate"]["RULES"] == {"Sm100FwdConfig": "remove",
                                        "Sm100Fp8FwdConfig": "remove"}


def test_verdict_keeps_only_the_failed_feature_gated():
    from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig
    v = V.verdict({"platform": "gpu"}, _rows(fail={"bf16 h128 window"}), TESTS, CLEAN)
    assert v["status"] == "partial"
    assert v["features"]["Sm100FwdConfig"]["window"] is False
    assert v["features"]["Sm100FwdConfig"]["causal"] is True
    assert v["clear_gate"]["RULES"]["Sm100Fp8FwdConfig"] == "remove"
    rules = _gate(v["clear_gate"]["RULES"]["Sm100FwdConfig"])["Sm100FwdConfig"]
    assert [name.split(" ")[0] for name, _ in rules] == ["window"]
    pred = rules[0][1]
    assert pred(Sm100FwdConfig(has_window=True)) and not pred(Sm100FwdConfig(is_causal=True))


def test_verdict_keeps_the_gate_on_sanitizer_errors_or_failed_tests():
    dirty = {"memcheck": {"clean": True}, "racecheck": {"clean": False, "errors": 3}}
    v = V.verdict({"platform": "gpu"}, _rows(), TESTS, dirty)
    assert v["status"] == "fail"
    assert all(r.startswith("keep") for r in v["clear_gate"]["RULES"].values())
    failed = dict(TESTS, **{"tests/kernels/test_sm100_fp8_gpu.py::test_c": "failed"})
    v = V.verdict({"platform": "gpu"}, _rows(), failed, CLEAN)
    assert v["clear_gate"]["RULES"]["Sm100Fp8FwdConfig"].startswith("keep")
    assert v["clear_gate"]["RULES"]["Sm100FwdConfig"] == "remove"
    # no sanitizer run at all is not clean either
    assert V.verdict({}, _rows(), TESTS, {})["status"] == "fail"


def test_a_failed_plain_case_keeps_the_whole_class_gated():
    v = V.verdict({"platform": "gpu"}, _rows(fail={"bf16 h128 dense gqa4 odd"}), TESTS, CLEAN)
    assert v["clear_gate"]["RULES"]["Sm100FwdConfig"].startswith("keep")
    assert v["features"]["Sm100FwdConfig"]["head_dim_128"] is False


def test_the_2cta_tests_clear_two_cta_only():
    """The 2-CTA forward (never dispatched, so in no check case) is cleared by its own GPU
    tests: failed or not run, only ``two_cta`` stays gated."""
    from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig
    for tests in (dict(TESTS, **{"tests.kernels.test_sm100_2cta_gpu::test_q": "failed"}),
                  {k: o for k, o in TESTS.items() if "2cta" not in k}):
        v = V.verdict({"platform": "gpu"}, _rows(), tests, CLEAN)
        assert v["status"] == "partial"
        rules = _gate(v["clear_gate"]["RULES"]["Sm100FwdConfig"])["Sm100FwdConfig"]
        assert [name.split(" ")[0] for name, _ in rules] == ["two_cta"]
        assert rules[0][1](Sm100FwdConfig(head_dim=192, two_cta=True))
        assert not rules[0][1](Sm100FwdConfig(head_dim=192))
        assert v["clear_gate"]["RULES"]["Sm100Fp8FwdConfig"] == "remove"


def test_a_failed_head_dim_192_case_gates_that_head_dim_only():
    """Head dim 192 has its own tiles (64 keys, 3 stages): its plain case failing keeps hd 192
    gated and clears the rest."""
    from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig
    v = V.verdict({"platform": "gpu"}, _rows(fail={"bf16 h192 dense gqa odd"}), TESTS, CLEAN)
    rules = _gate(v["clear_gate"]["RULES"]["Sm100FwdConfig"])["Sm100FwdConfig"]
    assert [name.split(" ")[0] for name, _ in rules] == ["head_dim_192"]
    pred = rules[0][1]
    assert pred(Sm100FwdConfig(head_dim=192)) and not pred(Sm100FwdConfig(head_dim=96))
    assert v["features"]["Sm100FwdConfig"]["head_dim_96"] is True


@pytest.mark.compile
def test_every_kit_call_plans_onto_the_sm100_kernels(monkeypatch):
    """What the kit runs on a B200 (check cases, grid, the GPU test files' cases) is served by
    the sm100 kernels once the gate is open: planned here for sm_100a (no compile)."""
    pytest.importorskip("cutlass", reason="planning without the DSL needs artifacts")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxflash
    from devtools import devrun
    from jaxflash.kernels.policy import verified
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    sds = jax.ShapeDtypeStruct
    calls = list(kit._grid_and_test_calls())
    for name, cls, _, (B, T, S, N, K, H, dtype), ex in kit.CASES:
        fp8 = ex.get("fp8")
        dt = jnp.float8_e4m3fn if fp8 else jnp.dtype(dtype)
        scales = None
        if fp8:
            sc = lambda h, L: (sds((), jnp.float32) if fp8 == "tensor" else
                               sds((B, h), jnp.float32) if fp8 == "head" else
                               sds((B, h, -(-L // 128)), jnp.float32))
            scales = (sc(N, T), sc(K, S), sc(K, S))
        slopes, q_seg, kv_seg = devrun._alibi_and_segments(ex, B, T, S, N)
        qs = np.asarray(ex["q_seqlen"], np.int32) if "q_seqlen" in ex else None
        kvs = np.asarray(ex["kv_seqlen"], np.int32) if "kv_seqlen" in ex else None
        kw, want = kit._call(name, ex, None, None, None, scales, qs, kvs, slopes, q_seg, kv_seg)
        kw.pop("implementation")
        calls.append((name, sds((B, T, N, H), dt), sds((B, S, K, H), dt), kw))
    assert len(calls) > 40
    for name, q, k, kw in calls:
        with jaxflash.target_platform("cuda"):
            plan = jaxflash.explain(q, k, k, implementation="cute", **kw)
        assert plan.backend == "cute", (name, str(plan))
        want = ":FlashFwdSm100Fp8" if "q_scale" in kw else ":FlashFwdSm100"
        assert plan.detail.fwd.kernel.endswith(want) and plan.detail.fwd.arch == "sm_100a", name


def test_kit_builds_every_backward_pass(monkeypatch):
    """`build` also compiles the backward GPU test's variants (`test_sm100_bwd_gpu.CASES`):
    each plans onto `FlashBwdSm100`, the head dim 256 cases onto both passes."""
    pytest.importorskip("cutlass", reason="planning without the DSL needs artifacts")
    import jaxflash
    from jaxflash.kernels.policy import verified
    from jaxflash.kernels.variants.sm100_bwd_launch import pass_launches
    monkeypatch.setenv(verified.ENV, "1")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    passes = {}
    for name, q, k, kw in kit._bwd_test_calls():
        with jaxflash.target_platform("cuda"):
            plan = jaxflash.explain(q, k, k, implementation="cute", **kw)
        assert plan.detail.bwd is not None, (name, str(plan))
        assert plan.detail.bwd.kernel.endswith(":FlashBwdSm100"), name
        passes[name] = [one.config.bwd_pass for one in pass_launches(plan.detail.bwd)]
    hd256 = [n for n in passes if "h256" in n]
    assert len(hd256) >= 3 and all(passes[n] == ["dv", "dkdq"] for n in hd256), passes
    assert all(passes[n] == ["all"] for n in passes if n not in hd256), passes
