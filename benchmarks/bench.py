"""Attention benchmark: every implementation over the anchor grid, forward and forward+backward.

    python -m benchmarks.bench                              # full grid, every implementation
    python -m benchmarks.bench --impl cute,cudnn --mode fwd --d 128 --s 16384
    python -m benchmarks.bench --quick --impl xla,pallas    # seconds, on CPU too

Grid (../shared/anchors/): bf16, B*S = 16384 tokens, N*D = 2048, D in {64, 128, 256},
S in {1k, 4k, 16k}, causal 0/1. TFLOP/s count 4*B*N*S^2*D for the forward (halved when causal)
and 3.5x that for forward+backward. Each point gets fresh random normal inputs (never zeros).
Each implementation's output (forward) or gradients (forward+backward) are first compared with
the baseline's on the same inputs (cuDNN on a GPU; see impls.CHECK_BASELINES) and forward outputs
also with an exact float32 reference on sampled rows; a failing implementation is recorded as
"wrong" and never timed. One that cannot run a point is recorded with its error text.
Timing is described in benchmarks/timing.py. Every row is written to the JSON as it is measured,
so a run cut short keeps what it measured; the table, markdown and PNG come at the end.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import sys
import threading
import time

if __package__ in (None, ""):  # `python benchmarks/bench.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import checks, envinfo, grid, impls, report, timing  # noqa: E402

# Implementations whose compilation is CPU-bound (Triton or CuTe DSL lowering) and runs nothing on
# the device: a phase's programs for these are compiled together in threads before the phase is
# timed, so compile time overlaps itself, never a measurement. XLA and cuDNN programs compile in
# the measuring thread: XLA's GPU compiler autotunes on the device, and parallel autotuning could
# disturb its choices (and so the peers' figures).
PRECOMPILE = ("cute", "pallas", "pallas-triton", "tokamax")

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="all",
                   help=f"comma-separated subset of {list(impls.IMPLS)} (default all)")
    p.add_argument("--d", type=_ints, default=None, help="head dims (default 64,128,256)")
    p.add_argument("--s", type=_ints, default=None, help="sequence lengths (default 1k,4k,16k)")
    p.add_argument("--causal", type=_ints, default=None, help="0, 1 or 0,1 (default 0,1)")
    p.add_argument("--mode", default="fwd,fwdbwd", help="fwd, fwdbwd or fwd,fwdbwd (default)")
    p.add_argument("--tokens", type=int, default=None, help="B*S (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="N*D (default 2048)")
    p.add_argument("--quick", action="store_true",
                   help="tiny problem (D=32, S=64, B*S=128, N*D=64) and few reps: a smoke run")
    p.add_argument("--no-latency", action="store_true", help="skip the small-call latency point")
    p.add_argument("--reps", type=int, default=None, help="timed reps per point (default 7)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting measurements after this many seconds (rest: 'skipped')")
    p.add_argument("--stall-s", type=float, default=240.0,
                   help="a single measurement taking longer is taken for a hang: the row is "
                        "recorded and the process exits (status 3) so the JSON survives")
    p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help=f"threads compiling {PRECOMPILE} ahead of each phase (0: compile "
                        f"lazily)")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default benchmarks/results)")
    p.add_argument("--name", default="bench", help="file stem: NAME.json, NAME.png, NAME.md")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.mode.replace("+", "").split(",") if m.strip()]
    bad = [m for m in a.modes if m not in grid.MODES]
    if bad:
        p.error(f"--mode must be among {grid.MODES}; got {bad}")
    if a.causal is not None and any(c not in (0, 1) for c in a.causal):
        p.error("--causal takes 0, 1 or 0,1")
    q = a.quick
    a.d = a.d or ([32] if q else list(grid.FULL_D))
    a.s = a.s or ([64] if q else list(grid.FULL_S))
    a.causal = a.causal if a.causal is not None else [0, 1]
    a.tokens = a.tokens or (2 * max(a.s) if q else grid.FULL_TOKENS)
    a.hidden = a.hidden or (2 * max(a.d) if q else grid.FULL_HIDDEN)
    a.reps = a.reps or (3 if q else 7)
    a.min_rep_s = 0.002 if q else 0.025
    a.latency_calls = 5 if q else 200
    try:
        a.impls = impls.parse(a.impl)
    except ValueError as e:
        p.error(str(e))
    return a


def _error_text(e: BaseException, limit=600) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > limit:
        msg = msg[:limit] + " ..."
    return f"{type(e).__name__}: {msg}"


class Recorder:
    """Holds the results and rewrites the JSON after every row (partial results survive)."""

    def __init__(self, out_dir, name, env, config):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, name + ".json")
        self.data = {"env": env, "config": config, "rows": []}
        self.save()

    def add(self, row):
        self.data["rows"].append(row)
        self.save()
        print(report.row_line(row), flush=True)

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, allow_nan=False, default=_json_default)
        os.replace(tmp, self.path)


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x))


def _finite(x):
    return None if x is None or not math.isfinite(x) else float(x)


class Runner:
    def __init__(self, args, rec: Recorder):
        self.args = args
        self.rec = rec
        self.t_start = time.perf_counter()
        self.seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._fns = {}
        self._compiled = {}  # (impl, mode, point) -> (Compiled, seconds) or the exception
        self._current = None  # (row, started) of the measurement in progress, for the watchdog
        if args.stall_s:
            threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self):
        """A kernel that hangs would hold the device until the call's limit and lose every later
        row; record it and leave instead (the JSON already holds every earlier row)."""
        while True:
            time.sleep(1.0)
            cur = self._current
            if cur is not None and time.perf_counter() - cur[1] > self.args.stall_s:
                row = dict(cur[0], status="error",
                           error=f"stalled: no result after {self.args.stall_s:.0f} s (hang?); "
                                 f"run aborted here")
                self.rec.add(row)
                print("watchdog: aborting the run", flush=True)
                os._exit(3)

    def _measuring(self, row):
        self._current = None if row is None else (row, time.perf_counter())

    # -- building blocks -------------------------------------------------------------------

    def fn(self, impl, mode, causal):
        """The jitted callable for (impl, mode, causal); jit's own cache covers the shapes."""
        key = (impl.name, mode, causal)
        if key not in self._fns:
            def fwd(q, k, v):
                return impl.attn(q, k, v, causal)
            if mode == "fwd":
                self._fns[key] = jax.jit(fwd)
            else:
                def fwdbwd(q, k, v, do):
                    _, vjp = jax.vjp(fwd, q, k, v)
                    return vjp(do)
                self._fns[key] = jax.jit(fwdbwd)
        return self._fns[key]

    def precompile(self, mode, group, pts):
        """Compile the PRECOMPILE implementations of a phase at every point, in threads."""
        todo = [(impl, p) for impl in group if impl.name in PRECOMPILE for p in pts
                if impl.skip_reason(p) is None]
        if not todo or self.args.compile_workers <= 0 or self.over_budget():
            return

        def job(impl, p):
            spec = jax.ShapeDtypeStruct((p.B, p.S, p.N, p.D), jnp.bfloat16)
            t0 = time.perf_counter()
            compiled = self.fn(impl, mode, p.causal).lower(*[spec] * (3 if mode == "fwd" else 4))
            compiled = compiled.compile()
            return compiled, time.perf_counter() - t0

        t0 = time.perf_counter()
        ex = concurrent.futures.ThreadPoolExecutor(self.args.compile_workers)
        futs = {(impl.name, mode, p): ex.submit(job, impl, p) for impl, p in todo}
        wait_s = self.args.stall_s
        if self.args.budget_s is not None:  # never wait far past the run's budget
            left = self.args.budget_s - (time.perf_counter() - self.t_start)
            wait_s = min(wait_s, max(10.0, left))
        concurrent.futures.wait(futs.values(), timeout=wait_s)
        ex.shutdown(wait=False, cancel_futures=True)
        for key, fut in futs.items():
            if not fut.done():
                self._compiled[key] = TimeoutError(
                    f"compilation not finished after {wait_s:.0f} s")
            elif fut.exception() is not None:
                self._compiled[key] = fut.exception()
            else:
                self._compiled[key] = fut.result()
        print(f"# compiled {len(todo)} programs ahead in {time.perf_counter() - t0:.1f} s "
              f"({self.args.compile_workers} threads)", flush=True)

    def inputs(self, index, p: grid.Point, mode):
        key = jax.random.fold_in(jax.random.key(self.seed), index)
        shape = (p.B, p.S, p.N, p.D)
        ks = jax.random.split(key, 4)
        xs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in ks]
        return xs[:3] if mode == "fwd" else xs

    def over_budget(self):
        b = self.args.budget_s
        return b is not None and time.perf_counter() - self.t_start > b

    def base_row(self, impl, p, mode):
        return dict(impl=impl, mode=mode, B=p.B, S=p.S, N=p.N, D=p.D, causal=int(p.causal),
                    status=None, ms=None, ms_min=None, ms_max=None, n_calls=None, reps=None,
                    tflops=None, rel_l2=None, rel_l2_parts=None, ref_err=None,
                    check_against=None, compile_s=None, first_call_s=None, error=None)

    # -- one point ------------------------------------------------------------------------

    def baseline(self, p, mode, args):
        """(name, output) of the first baseline that runs at p, or (None, reasons)."""
        reasons = []
        for name in impls.CHECK_BASELINES:
            impl = impls.IMPLS[name]
            why = impl.skip_reason(p)
            if why:
                reasons.append(f"{name}: {why}")
                continue
            try:
                out = jax.block_until_ready(self.fn(impl, mode, p.causal)(*args))
                return name, out
            except Exception as e:  # noqa: BLE001 - recorded, next baseline tried
                reasons.append(f"{name}: {_error_text(e, 200)}")
        return None, "; ".join(reasons)

    def run_point(self, index, p, mode, group):
        """Measure `group` at point p; the recorder gets each row as soon as it is done."""
        if self.over_budget():
            for impl in group:
                r = self.base_row(impl.name, p, mode)
                r.update(status="skipped", error="time budget of the run spent")
                self.rec.add(r)
            return
        args = self.inputs(index, p, mode)
        rows_ref = checks.sample_rows(p.S, 64, self.seed + index)
        base_name, base = self.baseline(p, mode, args)
        for impl in group:
            r = self.base_row(impl.name, p, mode)
            self.measure(r, impl, p, mode, args, base_name, base, rows_ref)
            self.rec.add(r)

    def measure(self, r, impl, p, mode, args, base_name, base, rows_ref):
        why = impl.skip_reason(p)
        if why:
            r.update(status="skipped", error=why)
            return
        if self.over_budget():
            r.update(status="skipped", error="time budget of the run spent")
            return
        if base_name is None:
            r.update(status="error", error=f"no baseline could run here to check against ({base})")
            return
        self._measuring(r)
        try:
            pre = self._compiled.pop((impl.name, mode, p), None)
            if isinstance(pre, BaseException):
                raise pre
            if pre is not None:
                f, r["compile_s"] = pre[0], round(pre[1], 3)
            else:
                f = self.fn(impl, mode, p.causal)
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*args))
            r["first_call_s"] = round(time.perf_counter() - t0, 3)
            ok = self.check(r, out, base, base_name, impl.name, args, p, mode, rows_ref)
            del out
            if not ok:
                r["status"] = "wrong"
                return
            t = timing.time_throughput(f, args, reps=self.args.reps,
                                       min_rep_s=self.args.min_rep_s)
            r.update(status="ok", ms=t.median_s * 1e3, ms_min=t.min_s * 1e3,
                     ms_max=t.max_s * 1e3, n_calls=t.n, reps=t.reps,
                     tflops=grid.flops(p, mode) / t.median_s / 1e12)
        except Exception as e:  # noqa: BLE001 - an implementation's failure is a result
            r.update(status="error", error=_error_text(e))
        finally:
            self._measuring(None)

    def check(self, r, out, base, base_name, name, args, p, mode, rows_ref):
        r["check_against"] = base_name
        if mode == "fwd":
            r["rel_l2"] = _finite(0.0 if name == base_name else checks.rel_l2(out, base))
            q, k, v = args
            r["ref_err"] = _finite(checks.sampled_reference_error(out, q, k, v, p.causal,
                                                                  rows_ref))
            ok = (checks.passes(r["rel_l2"], checks.FWD_TOL)
                  and checks.passes(r["ref_err"], checks.FWD_TOL))
        else:
            parts = [0.0] * 3 if name == base_name else [checks.rel_l2(g, b)
                                                          for g, b in zip(out, base)]
            r["rel_l2_parts"] = {"dq": _finite(parts[0]), "dk": _finite(parts[1]),
                                 "dv": _finite(parts[2])}
            r["rel_l2"] = _finite(max(parts)) if all(math.isfinite(x) for x in parts) else None
            ok = all(checks.passes(x, checks.GRAD_TOL) for x in parts)
        if not ok:
            tol = checks.FWD_TOL if mode == "fwd" else checks.GRAD_TOL
            r["error"] = (f"output check failed: rel L2 vs {base_name} {r['rel_l2']}, vs float32 "
                          f"reference on sampled rows {r['ref_err']} (limit {tol}); not timed")
        return ok

    # -- the latency point ------------------------------------------------------------------

    def latency(self):
        p = grid.Point(B=grid.LATENCY["B"], S=grid.LATENCY["S"], N=grid.LATENCY["N"],
                       D=grid.LATENCY["D"], causal=False)
        args = self.inputs(10_000, p, "fwd")
        rows_ref = np.arange(p.S, dtype=np.int32)
        order = ("cute", "pallas", "cudnn", "jax-xla", "xla", "pallas-triton", "tokamax")
        chosen = {i.name: i for i in self.args.impls}
        for name in sorted(chosen, key=lambda n: order.index(n) if n in order else len(order)):
            r = self.base_row(name, p, "latency")
            if self.over_budget():
                r.update(status="skipped", error="time budget of the run spent")
                self.rec.add(r)
                continue
            self._measuring(r)
            try:
                f = self.fn(chosen[name], "fwd", False)
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(*args))
                r["first_call_s"] = round(time.perf_counter() - t0, 3)
                r["check_against"] = "float32 reference"
                r["ref_err"] = _finite(checks.sampled_reference_error(out, *args, False,
                                                                      rows_ref))
                if not checks.passes(r["ref_err"], checks.FWD_TOL):
                    r.update(status="wrong", error=f"output check failed: rel L2 vs float32 "
                                                   f"reference {r['ref_err']}; not timed")
                else:
                    t = timing.time_latency(f, args, calls=self.args.latency_calls,
                                            warmup=max(2, self.args.latency_calls // 10))
                    r.update(status="ok", ms=t.median_s * 1e3, ms_min=t.min_s * 1e3,
                             ms_max=t.max_s * 1e3, n_calls=1, reps=t.reps)
            except Exception as e:  # noqa: BLE001
                r.update(status="error", error=_error_text(e))
            finally:
                self._measuring(None)
            self.rec.add(r)

    # -- the whole run ----------------------------------------------------------------------

    def run(self):
        pts = grid.points(self.args.d, self.args.s, self.args.causal, self.args.tokens,
                          self.args.hidden)
        index = {pt: i for i, pt in enumerate(pts)}
        for n, (mode, group) in enumerate(impls.phases(self.args.impls, self.args.modes)):
            print(f"# {mode}: {', '.join(i.name for i in group)}", flush=True)
            self.precompile(mode, group, pts)
            for pt in pts:
                self.run_point(index[pt], pt, mode, group)
            if n == 0 and not self.args.no_latency:
                print("# latency: B=1, N=1, T=S=128, D=64, forward, wall time per call",
                      flush=True)
                self.latency()
        if not self.args.modes and not self.args.no_latency:
            self.latency()


def main(argv=None):
    args = parse_args(argv)
    env = envinfo.collect()
    if env["platform"] == "gpu" and not args.quick:
        try:
            env["matmul_bf16_tflops"] = round(envinfo.matmul_ceiling(), 1)
        except Exception as e:  # noqa: BLE001
            env["matmul_bf16_tflops"] = _error_text(e, 200)
    config = dict(impls=[i.name for i in args.impls], d=args.d, s=args.s, causal=args.causal,
                  modes=args.modes, tokens=args.tokens, hidden=args.hidden, dtype="bfloat16",
                  reps=args.reps, min_rep_s=args.min_rep_s, quick=args.quick,
                  latency=not args.no_latency, budget_s=args.budget_s,
                  check_tol={"fwd": checks.FWD_TOL, "fwdbwd": checks.GRAD_TOL},
                  argv=list(sys.argv[1:] if argv is None else argv))
    rec = Recorder(args.out, args.name, env, config)
    print(f"# {env['device']} ({env['platform']}), jax {env['jax']}, cuDNN {env['cudnn']}, "
          f"-> {rec.path}", flush=True)
    runner = Runner(args, rec)
    config["seed"] = runner.seed
    t0 = time.perf_counter()
    try:
        runner.run()
    finally:
        config["wall_s"] = round(time.perf_counter() - t0, 1)
        rec.save()
        md_path = os.path.join(args.out, args.name + ".md")
        text = report.markdown(rec.data)
        with open(md_path, "w") as f:
            f.write(text)
        print("\n" + text, flush=True)
        try:
            from benchmarks import plot
            plot.plot(rec.data, os.path.join(args.out, args.name + ".png"))
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
            print(f"plot failed: {_error_text(e)}", flush=True)
    return rec.data


if __name__ == "__main__":
    main()
