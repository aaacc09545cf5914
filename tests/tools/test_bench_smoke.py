"""The benchmark harness runs end to end on CPU on a tiny grid, writes JSON / PNG / markdown, and
refuses to time an implementation whose output is wrong."""
from __future__ import annotations

import json
import math
import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench, grid, impls, report  # noqa: E402

STATUSES = {"ok", "error", "wrong", "skipped"}


def _run(tmp_path, *extra):
    out = tmp_path / "res"
    data = bench.main(["--quick", "--out", str(out), "--name", "smoke", "--seed", "7", *extra])
    return out, data


@pytest.mark.slow
def test_quick_run_writes_sane_results(tmp_path):
    out, data = _run(tmp_path, "--impl", "xla,pallas")
    for ext in ("json", "png", "md"):
        assert (out / f"smoke.{ext}").stat().st_size > 0, ext
    with open(out / "smoke.json") as f:
        saved = json.load(f)
    assert saved["rows"] == data["rows"]
    env = saved["env"]
    for k in ("device", "date_utc", "jax", "jaxlib", "cudnn", "platform"):
        assert k in env
    rows = saved["rows"]
    # 2 points (causal 0/1) x 2 modes x 2 impls, plus one latency row per impl.
    assert len(rows) == 2 * 2 * 2 + 2
    assert {r["status"] for r in rows} <= STATUSES
    for r in rows:
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
            if r["mode"] != "latency":
                assert r["tflops"] == pytest.approx(
                    grid.flops(grid.Point(r["B"], r["S"], r["N"], r["D"], bool(r["causal"])),
                               r["mode"]) / (r["ms"] * 1e-3) / 1e12)
                assert 0 <= r["rel_l2"] <= 2e-2 * (2.5 if r["mode"] == "fwdbwd" else 1)
        else:  # every row that did not run says why
            assert r["error"], r
    xla = [r for r in rows if r["impl"] == "xla"]
    assert all(r["status"] == "ok" for r in xla), [r["error"] for r in xla]
    # No cuDNN on CPU: checked against jax.nn's XLA path instead, and said so.
    assert {r["check_against"] for r in xla if r["mode"] != "latency"} == {"jax-xla"}
    assert all(r["ref_err"] < 2e-2 for r in xla if r["mode"] in ("fwd", "latency"))
    text = (out / "smoke.md").read_text()
    assert "forward+backward" in text and "| 32 | 64 | 1 |" in text


def test_wrong_kernel_is_not_timed(tmp_path, monkeypatch):
    def broken(q, k, v, causal):  # plausible shape and dtype, wrong values
        return (v * 1.5).astype(q.dtype)
    monkeypatch.setitem(impls.IMPLS, "broken", impls.Impl("broken", "test", broken))
    _, data = _run(tmp_path, "--impl", "broken", "--mode", "fwd", "--causal", "1",
                   "--no-latency")
    (r,) = data["rows"]
    assert r["status"] == "wrong" and r["ms"] is None and r["tflops"] is None
    assert r["rel_l2"] > 0.1 and "check failed" in r["error"]


def test_nan_output_fails_the_check():
    x = jnp.ones((2, 3)).at[0, 0].set(jnp.nan)
    err = bench.checks.rel_l2(x, jnp.ones((2, 3)))
    assert math.isnan(err) and not bench.checks.passes(err, 1.0)


def test_flops_and_report_ratios():
    p = grid.Point(B=16, S=1024, N=32, D=64, causal=False)
    assert grid.flops(p, "fwd") == 4 * 16 * 32 * 1024 ** 2 * 64
    pc = grid.Point(B=16, S=1024, N=32, D=64, causal=True)
    assert grid.flops(pc, "fwdbwd") == 3.5 * grid.flops(p, "fwd") / 2
    assert [pt.B for pt in grid.points([64], [1024, 16384], [0], 16384, 2048)] == [16, 1]

    def row(impl, tf):
        return dict(impl=impl, mode="fwd", B=16, S=1024, N=32, D=64, causal=0, status="ok",
                    ms=1.0, tflops=tf)
    lines, notes = report.mode_table([row("cudnn", 400.0), row("cute", 500.0)], "fwd")
    assert lines[0].startswith("| D | S | causal | cute | cudnn | cute/cuDNN |")
    assert lines[2].endswith("| 1.25 |") and "1.250" in notes[0]


def test_long_context_script_runs_and_checks(tmp_path):
    """benchmarks/long_context.py on CPU with the reference backend at a small size: it must
    produce a result whose row check and finiteness checks pass (the GPU run is at 128k)."""
    import json

    from benchmarks import long_context
    out = tmp_path / "lc.json"
    assert long_context.main(["--s", "300", "--heads", "2", "--kv-heads", "1", "--d", "64",
                              "--impl", "xla", "--causal", "1", "--reps", "1",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and res["rel_l2_out_rows_vs_float64"] < 2e-2
    assert max(res["rows_checked"]) < 300


ANCHORS_MD = """\
| D | S | causal | FA4-sm90 fwd | tokamax-mosaic fwd | cuDNN fwd (FA4's run) |
|---|---|---|---|---|---|
| 64 | 1024 | 0 | 400 | 1 | 390 |
| 64 | 1024 | 1 | 250 | 1 | 300 |

Prose between the tables.

| D | S | causal | FA4-sm90 fwd+bwd | cuDNN fwd+bwd (same run) | ratio | rel-L2 |
|---|---|---|---|---|---|---|
| 64 | 1024 | 0 | 200 | 180 | 1.11 | 0.001 |
"""


def test_anchor_comparison_divides_by_fa4_figures():
    """`benchmarks.anchors`: FA4's forward and forward+backward tables are told apart by their
    headers, and the geomean is over our / FA4 TFLOP/s at the points both have."""
    from benchmarks import anchors
    a = anchors.parse_anchors(ANCHORS_MD)
    assert a["fwd"] == {(64, 1024, 0): (400.0, 390.0), (64, 1024, 1): (250.0, 300.0)}
    assert a["fwdbwd"] == {(64, 1024, 0): (200.0, 180.0)}
    row = lambda impl, mode, c, tf: dict(impl=impl, mode=mode, D=64, S=1024, causal=c,
                                         status="ok", tflops=tf)
    rows = [row("cute", "fwd", 0, 200.0), row("cute", "fwd", 1, 500.0),
            row("cudnn", "fwd", 0, 1.0), row("cute", "fwdbwd", 0, 100.0)]
    res = anchors.compare(rows, a)
    assert math.isclose(res["fwd"]["geomean"], 1.0) and res["fwd"]["missing"] == []
    assert math.isclose(res["fwdbwd"]["geomean"], 0.5)
    with pytest.raises(ValueError, match="anchors file lacks"):
        anchors.parse_anchors(ANCHORS_MD.split("Prose")[0])
    real = anchors.DEFAULT_ANCHORS
    if os.path.exists(real):  # the workplace's file: both tables, the whole grid
        with open(real) as f:
            got = anchors.parse_anchors(f.read())
        assert len(got["fwd"]) == len(got["fwdbwd"]) == 18
        assert got["fwd"][(128, 16384, 0)][0] == 677.0


def test_interleaved_timing_takes_reps_in_turn(monkeypatch):
    """`time_interleaved` times every call once per round, round after round (so a drift over
    the run lands on all of them), and reports each one's median per call."""
    import jax

    from benchmarks import timing
    order = []

    def make(name):
        f = jax.jit(lambda x: x * 2.0)

        def call(x):
            order.append(name)
            return f(x)
        return call

    x = jnp.ones((8,))
    out = timing.time_interleaved({"a": make("a"), "b": make("b")}, (x,), reps=3,
                                  min_rep_s=0.0, max_n=1)
    assert set(out) == {"a", "b"} and all(t.reps == 3 and t.n == 1 for t in out.values())
    assert all(t.min_s <= t.median_s <= t.max_s for t in out.values())
    timed = order[-6:]  # after each one's warm-up and estimate calls
    assert timed == ["a", "b"] * 3, order


def test_fp8_bench_variants_trace_under_their_own_settings():
    """`fp8_bench`'s variant columns: a module constant set while a variant traces takes
    effect even when the same Python function was traced (and cached by jit) before under the
    default. jit (jax 0.10-0.11) shares the trace of one function object across its
    wrappers, so `_traced_under` jits a function of its own."""
    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_bench import KM_IMPL, _traced_under
    from jaxflash.kernels.variants import keys_major as KM

    def f(x):
        return x * (2.0 if KM.IMPL == "triton" else 3.0)

    one = jnp.ones(())
    default = float(jax.jit(f)(one))
    other = "xla" if KM.IMPL == "triton" else "triton"
    want = 2.0 if other == "triton" else 3.0
    own = _traced_under(f, {KM_IMPL: other})
    assert float(own(one)) == want != default
