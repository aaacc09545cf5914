"""The documents stay true: the README's usage example runs as pasted, the README stays short,
docs/performance.md is what `python -m benchmarks.performance_doc` generates, and the README's
headline table is the one that page computes from the result files."""
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _performance_doc():
    path = os.path.join(ROOT, "benchmarks", "performance_doc.py")
    spec = importlib.util.spec_from_file_location("_jaxflash_performance_doc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_usage_example_runs_as_pasted(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", _readme(), re.S | re.M)
    assert blocks, "README.md has no ```python block"
    exec(compile(blocks[0], "README.md usage example", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert "runs" in printed  # the explain() line: which backend runs, and why


def test_readme_is_short():
    n = len(_readme().splitlines())
    assert n <= 220, f"README.md has {n} lines; a user's document stays under ~200"


def test_performance_page_is_up_to_date():
    assert _performance_doc().main(["--check"]) == 0, (
        "docs/performance.md is stale: run python -m benchmarks.performance_doc")


def test_readme_headline_table_matches_the_results():
    mod = _performance_doc()
    _, rows = mod.grid_numbers()
    readme = _readme()
    for line in mod.summary_table(rows):
        assert line in readme, f"README.md headline table lacks {line!r} (from the result files)"
