"""Sequence-parallel (ring) attention scaling: one long causal sequence on 1 GPU vs P GPUs.

    python -m benchmarks.ring_scaling --out benchmarks/results/ring-pallas-h200x2-DATE.json
    python -m benchmarks.ring_scaling --s 4096 --impl xla        # a CPU smoke run

On one device: `jaxflash.flash_attention` on the whole sequence. On P devices: `ring_attention`
over a P-way sequence mesh, zigzag (load-balanced) and, when asked, contiguous layout, each
block through the same backend. Forward and forward+backward (grad of sum(out * w)). bf16,
B=1, causal; TFLOP/s count the causal half: 2 * 2 * B * N * S^2 * D / 2 (x 3.5 with backward).
Timing: benchmarks/timing.py (throughput, median of reps). Rows are written as measured;
`--budget-s` stops starting new rows once exceeded, so a run keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflash  # noqa: E402
from benchmarks import envinfo, timing  # noqa: E402
from jaxflash.ring import to_zigzag  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--s", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--impl", default="pallas")
    ap.add_argument("--layouts", default="zigzag", help="comma-separated ring layouts")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    S, N, K, D = a.s, a.heads, a.kv_heads, a.d
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, S, N, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, S, K, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, K, D), jnp.bfloat16)
    w = jax.random.normal(ks[3], (1, S, N, D), jnp.bfloat16)
    flops_fwd = 2 * 2 * N * S * S * D / 2
    result = {"env": envinfo.collect(), "config": vars(a), "rows": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    def run(name, devices, fn, args, w, mode):
        if time.perf_counter() - t_start > a.budget_s:
            result["rows"].append({"name": name, "mode": mode, "skipped": "time budget"})
            return
        f = fn
        if mode == "fwdbwd":
            f = jax.grad(lambda q, k, v, w: jnp.sum(fn(q, k, v).astype(jnp.float32) * w),
                         argnums=(0, 1, 2))
            args = args + (w,)
        jf = jax.jit(f)
        row = {"name": name, "devices": devices, "mode": mode, "S": S, "N": N, "K": K, "D": D}
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(jf(*args))
            row["compile_and_first_s"] = round(time.perf_counter() - t0, 3)
            t = timing.time_throughput(jf, args, reps=a.reps, min_rep_s=0.2, warmup=1)
            fl = flops_fwd * (3.5 if mode == "fwdbwd" else 1.0)
            row.update(ms=round(t.median_s * 1e3, 3), min_ms=round(t.min_s * 1e3, 3),
                       max_ms=round(t.max_s * 1e3, 3), n=t.n, reps=t.reps,
                       tflops=round(fl / t.median_s / 1e12, 1))
        except Exception as e:  # noqa: BLE001 - record and go on to the next row
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        save()

    modes = a.modes.split(",")
    one = lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                   implementation=a.impl)
    jobs = {"single": (1, one, (q, k, v), w)}
    n = jax.device_count()
    if n > 1:
        mesh = Mesh(np.array(jax.devices()), ("seq",))
        spec = NamedSharding(mesh, P(None, "seq"))
        for layout in a.layouts.split(","):
            perm = (lambda x: to_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
            args = tuple(jax.device_put(perm(x), spec) for x in (q, k, v))
            ring = (lambda layout: lambda q, k, v: jaxflash.ring_attention(
                q, k, v, mesh=mesh, seq_axis="seq", layout=layout, is_causal=True,
                implementation=a.impl))(layout)
            jobs[f"ring-{layout}"] = (n, ring, args, jax.device_put(perm(w), spec))
    # Mode-major, so that a run cut by --budget-s still has single vs ring for the first mode.
    for mode in modes:
        for name, (devices, fn, args, w_) in jobs.items():
            run(name, devices, fn, args, w_, mode)

    by = {(r["name"], r["mode"]): r for r in result["rows"] if "ms" in r}
    scaling = {}
    for (name, mode), r in by.items():
        base = by.get(("single", mode))
        if name != "single" and base:
            scaling[f"{name}/{mode}"] = {"speedup": round(base["ms"] / r["ms"], 3),
                                         "efficiency": round(base["ms"] / r["ms"] / n, 3)}
    result["scaling"] = scaling
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(scaling, indent=1))
    save()


if __name__ == "__main__":
    main()
