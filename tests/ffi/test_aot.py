"""`python -m jaxflash.aot`: variant selection, refusals, idempotence, errors (no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass", reason="needs the CuTe DSL compiler")
pytestmark = pytest.mark.compile

from jaxflash import aot  # noqa: E402
from jaxflash.ffi import cache  # noqa: E402


def _metas(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".json"))


def test_kernel_grid_builds_each_variant_once_then_keeps(tmp_path, capsys):
    out = tmp_path / "k"
    assert aot.main(["--arch", "sm_100a", "--out", str(out), "--kernel", "selftest",
                     "dtype=float32,bfloat16", "--no-progress"]) == 0
    metas = _metas(out)
    assert len(metas) == 2 and all("sm_100a" in m for m in metas)
    for m in metas:
        meta = json.load(open(out / m))
        assert meta["arch"] == "sm_100a" and meta["dsl_version"] == cache.dsl_version()
        assert os.path.getsize(out / m.replace(".json", ".o")) == meta["size"]
    assert "2 built, 0 up to date" in capsys.readouterr().out
    assert aot.main(["--arch", "sm_100a", "--out", str(out), "--kernel", "selftest",
                     "dtype=float32,bfloat16", "--no-progress"]) == 0
    assert "0 built, 2 up to date" in capsys.readouterr().out


def test_bad_selection_and_arch_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="FIELD=v1,v2"):
        aot.main(["--out", str(tmp_path), "--kernel", "selftest", "colour=red"])
    with pytest.raises(SystemExit, match="unknown kernel"):
        aot.main(["--out", str(tmp_path), "--kernel", "nope"])
    with pytest.raises(SystemExit, match="written for"):
        aot.main(["--arch", "sm_80", "--out", str(tmp_path), "--kernel", "selftest"])


def test_invalid_combinations_are_skipped_with_reason(tmp_path, capsys):
    launches, refused = aot.expand("selftest", ["dtype=float32,int8"], "sm_90a")
    assert len(launches) == 1 and len(refused) == 1
    assert refused[0][0] == {"dtype": "int8"} and "int8" in refused[0][1]


def test_cli_runs_as_a_module(tmp_path):
    env = dict(os.environ, JAXFLASH_CACHE_DIR=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-m", "jaxflash.aot", "--list"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "selftest" in r.stdout and "dtype='float32'" in r.stdout
