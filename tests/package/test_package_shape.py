"""The package's shape: layered imports (import-linter contracts in pyproject.toml), no import
cycles, nothing imported from the repository's lab folders, no dates or run times in code, no
oversized modules."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "jaxflash"
SOURCES = sorted(PKG.rglob("*.py"))


def test_import_contracts_hold():
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    r = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout


def test_no_import_cycles():
    grimp = pytest.importorskip("grimp")
    g = grimp.build_graph("jaxflash")
    edges = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    # Tarjan's strongly connected components: every one must be a single module.
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for m in sorted(edges):
        if m not in index:
            visit(m)
    cycles = [sorted(c) for c in comps if len(c) > 1]
    assert not cycles, cycles


def test_package_imports_nothing_from_the_lab():
    pat = re.compile(r"^\s*(from|import)\s+(benchmarks|devtools|tests|examples)\b", re.M)
    hits = [str(p.relative_to(ROOT)) for p in SOURCES if pat.search(p.read_text())]
    assert not hits, hits


def test_no_dates_or_run_times_in_package_code():
    pat = re.compile(r"20\d\d-\d\d-\d\d|\d\d:\d\d UTC")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, hits[:20]


def test_no_module_over_800_lines():
    big = {str(p.relative_to(ROOT)): n for p in SOURCES
           if (n := len(p.read_text().splitlines())) > 800}
    assert not big, big


def test_flax_layers_reachable_from_the_package():
    pytest.importorskip("flax")
    import jaxflash
    assert callable(jaxflash.flax_layers.attention_fn)
