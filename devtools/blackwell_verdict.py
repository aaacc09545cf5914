"""The first Blackwell run's verdict: which sm_100a features passed, and what to change in
`jaxflash/kernels/policy/verified.py` (`RULES`) to clear them. Pure Python (no JAX, no GPU), so
the rules are unit-tested on the CPU (tests/kernels/test_blackwell_first_run.py).

A feature passes when every float64 check case that exercises it passed, every GPU test of its
kernel class passed, and the sanitizers (memcheck, racecheck) reported no error. A feature that
did not pass keeps a rule (its predicate over the config, as source text to paste); a config
class whose features all passed loses its rule entirely.
"""
from __future__ import annotations

# Per config class: feature -> predicate source over the config `c` (what RULES holds). The
# features a check case names (`CASES` in devtools.blackwell_first_run) are these; "base" is
# the class itself (dense calls, GQA / MQA, odd lengths: no config field tells them apart, so if
# one fails the whole class stays pending).
FEATURES = {
    "Sm100FwdConfig": {
        "base": "True",
        "causal": "c.is_causal",
        "window": "c.has_window",
        "softcap": "c.has_softcap",
        "lengths": "c.has_q_seqlen or c.has_kv_seqlen",
        "alibi": "c.has_alibi",
        "segments": "c.has_segments",
        "fp16": "c.dtype == 'float16'",
        "head_dim_64": "c.head_dim == 64",
        "head_dim_96": "c.head_dim == 96",
        "head_dim_128": "c.head_dim == 128",
        "head_dim_192": "c.head_dim == 192",
        "head_dim_256": "c.head_dim == 256",
        "rescale": "c.rescale_threshold > 0",
        "two_cta": "c.two_cta",
    },
    "Sm100Fp8FwdConfig": {
        "base": "True",
        "causal": "c.is_causal",
        "window": "c.has_window",
        "softcap": "c.has_softcap",
        "lengths": "c.has_q_seqlen or c.has_kv_seqlen",
        "segments": "c.has_segments",
        "block_scales": "c.q_blocks or c.k_blocks or c.v_blocks",
        "head_dim_64": "c.head_dim == 64",
        "head_dim_128": "c.head_dim == 128",
        "head_dim_256": "c.head_dim == 256",
    },
}
# Features every case has one of (head dim, the exp2 / rescale path) and the class itself.
# Head dims 96 and 192 are not among them: they have their own tiles (SW64 rows at 96, 64-key
# tiles at 192), so a failed plain case of theirs gates that head dim, not the class.
COMMON = {"base", "rescale", "head_dim_64", "head_dim_128", "head_dim_256"}
# GPU test files -> the config class their tests clear (all of it: a failing test keeps the
# class's "base" rule). A backward test file the sm100 backward brings is matched by name.
TEST_CLASSES = (("test_sm100_fp8_gpu", "Sm100Fp8FwdConfig"),
                ("test_sm100_bwd", "Sm100BwdConfig"),
                ("test_sm100_gpu", "Sm100FwdConfig"))
# GPU test files that clear one feature of a class instead (its variants are never dispatched,
# so no check case reaches them): the 2-CTA forward, run on its launch directly.
TEST_FEATURES = (("test_sm100_2cta_gpu", "Sm100FwdConfig", "two_cta"),)


def test_class(nodeid: str) -> str | None:
    for stem, cls in TEST_CLASSES:
        if stem in nodeid:
            return cls
    return None


def test_feature(nodeid: str) -> tuple[str, str] | None:
    for stem, cls, feature in TEST_FEATURES:
        if stem in nodeid:
            return cls, feature
    return None


def features_passed(check_rows: list[dict], tests: dict[str, str],
                    sanitizers_clean: bool) -> dict[str, dict[str, dict]]:
    """{class: {feature: {"passed", "cases", "failed"}}} from the check rows (each with "cls",
    "features", "name", "ok"), the GPU tests ({nodeid: "passed" / "failed" / "skipped" /
    "error"}) and the sanitizers' outcome."""
    out: dict[str, dict[str, dict]] = {}
    for cls, feats in FEATURES.items():
        out[cls] = {f: {"passed": False, "cases": [], "failed": []} for f in feats}
    for row in check_rows:
        cls = row["cls"]
        feats = set(row["features"]) | {"base"}
        # a failed case is charged to the features that set it apart (a window case that
        # fails gates windows); one with none of those fails the class's base
        blamed = feats - COMMON or feats
        for f in feats:
            slot = out.setdefault(cls, {}).setdefault(
                f, {"passed": False, "cases": [], "failed": []})
            slot["cases"].append(row["name"])
            if not row.get("ok") and f in blamed:
                slot["failed"].append(row["name"])
    bad_tests: dict[str, list[str]] = {}
    ran_tests: dict[str, int] = {}
    for nodeid, outcome in tests.items():
        cls_feature = test_feature(nodeid)
        if cls_feature is not None:  # the feature's "cases" are its passed tests
            slot = out[cls_feature[0]][cls_feature[1]]
            if outcome in ("failed", "error"):
                slot["failed"].append(nodeid)
            elif outcome == "passed":
                slot["cases"].append(nodeid)
            continue
        cls = test_class(nodeid)
        if cls is None:
            continue
        out.setdefault(cls, {}).setdefault("base", {"passed": False, "cases": [], "failed": []})
        if outcome in ("failed", "error"):
            bad_tests.setdefault(cls, []).append(nodeid)
        elif outcome == "passed":
            ran_tests[cls] = ran_tests.get(cls, 0) + 1
    for cls, feats in out.items():
        for f, slot in feats.items():
            covered = bool(slot["cases"]) or (f == "base" and ran_tests.get(cls))
            slot["passed"] = bool(covered and not slot["failed"] and sanitizers_clean
                                  and not (f == "base" and bad_tests.get(cls)))
            if f == "base" and bad_tests.get(cls):
                slot["failed"] += bad_tests[cls]
    return out


def rules_change(passed: dict[str, dict[str, dict]]) -> dict[str, str]:
    """{class: the new RULES entry as source, or "remove"} for the sm_100a classes."""
    out = {}
    for cls, feats in passed.items():
        if feats.get("base", {}).get("passed") is False and "base" in feats:
            out[cls] = "keep (its base cases or tests failed, or did not run)"
            continue
        pending = [f for f, slot in feats.items() if f != "base" and not slot["passed"]]
        if not pending:
            out[cls] = "remove"
            continue
        preds = FEATURES.get(cls, {})
        items = ", ".join(f'("{f} (sm_100a, not cleared by the first Blackwell run)", '
                          f'lambda c: {preds.get(f, "True")})' for f in pending)
        out[cls] = f'"{cls}": ({items},),'
    return out


def verdict(device: dict, check_rows: list[dict], tests: dict[str, str],
            sanitizers: dict[str, dict], grid: dict | None = None) -> dict:
    """The JSON the kit writes (``verdict.json``)."""
    clean = bool(sanitizers) and all(s.get("clean") for s in sanitizers.values())
    passed = features_passed(check_rows, tests, clean)
    change = rules_change(passed)
    n_ok = sum(1 for r in check_rows if r.get("ok"))
    all_clear = all(v == "remove" for v in change.values())
    return {
        "status": ("pass" if all_clear else
                   "fail" if all(v.startswith("keep") for v in change.values()) else "partial"),
        "device": device,
        "checks": {"passed": n_ok, "total": len(check_rows)},
        "gpu_tests": {o: sum(1 for x in tests.values() if x == o)
                      for o in ("passed", "failed", "error", "skipped")},
        "sanitizers": sanitizers,
        "features": {cls: {f: s["passed"] for f, s in feats.items()}
                     for cls, feats in passed.items()},
        "failed_cases": {cls: {f: s["failed"] for f, s in feats.items() if s["failed"]}
                         for cls, feats in passed.items()},
        "clear_gate": {
            "file": "jaxflash/kernels/policy/verified.py",
            "RULES": change,
            "how": ("for each class: 'remove' deletes its RULES entry (every variant is "
                    "dispatched on compute capability 10.0); a source line replaces the entry "
                    "(only those features stay gated); 'keep' leaves it. Then list the run's "
                    "files (this directory) in docs/design.md beside the Hopper clearances."),
        },
        "grid": grid,
    }


def not_blackwell(device: dict) -> dict:
    """The verdict on any machine that is not a compute capability 10.0 GPU: nothing ran."""
    what = (f"a {device.get('kind') or device.get('platform')} device of compute capability "
            f"{device.get('compute_capability')}" if device.get("compute_capability")
            else f"no GPU ({device.get('platform', 'cpu')})")
    return {"status": "not_blackwell", "device": device,
            "message": (f"not a Blackwell GPU: found {what}; the sm_100a kernels need compute "
                        "capability 10.0 (B200 / GB200). Nothing was run and the gate "
                        "(jaxflash/kernels/policy/verified.py) stays as it is."),
            "clear_gate": None}
