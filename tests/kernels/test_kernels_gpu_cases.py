"""The Hopper kernels' float64 check cases as GPU tests: every case of devtools/fwd_cases.py
(forward: output and LSE) and devtools/bwd_cases.py (backward: dq / dk / dv, and the
determinism cases' bitwise repeats), one test each, through the device harness's own check
(`devtools.devrun.check`, `devtools.bwd_devrun.check` / `determinism`): fresh random inputs, the
kernel called directly (a missing artifact is an error, never a fallback), a float64 NumPy
oracle, the harness's tolerances, exact zeros / -inf on empty rows, a 60 s watchdog per case.

    python -m pytest -m gpu tests/kernels/test_kernels_gpu_cases.py   # on the H200
    python -m pytest tests/kernels/test_kernels_gpu_cases.py -m gpu -k "h128 and causal"

The GPU machine has no CuTe DSL: build the variants here first (``python -m devtools.devrun
build --out .device/kernels`` and ``python -m devtools.bwd_devrun build --out
.device/kernels``, or ``python -m tests.collect_variants --out .device/kernels
tests/kernels/test_kernels_gpu_cases.py``) and point ``JAXFLASH_KERNEL_DIR`` there. Without a
GPU only the consistency check of the case lists runs (cheap, no DSL).
"""
from __future__ import annotations

import json

import pytest

from devtools import bwd_devrun, devrun
from devtools.bwd_cases import CHECKS as BWD_CHECKS
from devtools.bwd_cases import DETERMINISM
from devtools.fwd_cases import CHECKS as FWD_CHECKS
from jaxflash.kernels.variants.fwd import FwdConfig


def _names(cases):
    return [name for name, _, _ in cases]


def _mismatches():
    """Every case whose inputs disagree with the features compiled into its config (the
    harness raises on these before running anything, and a wrong case would test a call that
    dispatch never makes)."""
    bad = []
    for name, kw, (_, _, _, _, _, ex) in FWD_CHECKS:
        bad.append(devrun.case_mismatch(name, FwdConfig(**kw), ex))
    for name, kw, (_, _, _, _, _, ex) in BWD_CHECKS + DETERMINISM:
        fcfg, bcfg = bwd_devrun._configs(kw)
        bad += [devrun.case_mismatch(name, fcfg, ex), devrun.case_mismatch(name, bcfg, ex)]
    return [b for b in bad if b]


@pytest.mark.cpu  # (runs in CI: this file's other tests are gpu by its name)
def test_case_lists_are_consistent():
    """CPU: names unique (a case is selected by name) and every case's inputs match its
    config's features, so each GPU test below checks what it says."""
    for cases in (FWD_CHECKS, BWD_CHECKS + DETERMINISM):
        names = _names(cases)
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not _mismatches(), "\n".join(_mismatches())


def _row(out_path, ok):
    rows = json.loads(out_path.read_text())
    assert len(rows) == 1, rows
    row = rows[0]
    assert ok and row["ok"], json.dumps(row, indent=1)
    return row


@pytest.mark.gpu
@pytest.mark.parametrize("name", _names(FWD_CHECKS))
def test_forward_case(name, tmp_path):
    out = tmp_path / "fwd_check.json"
    _row(out, devrun.check(str(out), {name}))


@pytest.mark.gpu
@pytest.mark.parametrize("name", _names(BWD_CHECKS))
def test_backward_case(name, tmp_path):
    out = tmp_path / "bwd_check.json"
    _row(out, bwd_devrun.check(str(out), {name}))


@pytest.mark.gpu
@pytest.mark.parametrize("case", DETERMINISM, ids=_names(DETERMINISM))
def test_backward_determinism(case, tmp_path, monkeypatch):
    """10 runs on the same inputs: deterministic variants bitwise equal (the default's spread
    is recorded in the row, for information)."""
    monkeypatch.setattr(bwd_devrun, "DETERMINISM", [case])
    out = tmp_path / "bwd_det.json"
    _row(out, bwd_devrun.determinism(str(out)))
