"""One forward+backward at a long context on one GPU: does it fit, how long does it take, is it
right where it can be checked.

    python3 -m benchmarks.long_context --s 131072 --impl cute --out $OUT/long_context.json

Issue 3 asks for T = S = 131072, B = 1, N = 16, D = 128 on one H200: memory beyond inputs and
outputs must be O(T + S) per head. Reported: wall time of a jitted value-and-grad (median of
`--reps`), the device's peak bytes in use against the bytes of q, k, v, dO, O, dq, dk, dv, and
which backward ran. Checked: no NaN/inf anywhere; for a handful of query rows the output
against a float64 numpy evaluation of those rows over every key (cheap: rows x S); the
gradients' norms are finite and nonzero (a full-size gradient reference does not fit a check).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from benchmarks import envinfo
from benchmarks.timing import time_throughput


def _rows_reference(q, k, v, rows, scale, causal):
    """float64 output of the given query rows, every head ([len(rows), N, D])."""
    qr = np.asarray(q[0, rows].astype(jnp.float32), np.float64)        # [r, N, D]
    kk = np.asarray(k[0].astype(jnp.float32), np.float64)              # [S, K, D]
    vv = np.asarray(v[0].astype(jnp.float32), np.float64)
    N, K = qr.shape[1], kk.shape[1]
    kk = np.repeat(kk, N // K, axis=1)
    vv = np.repeat(vv, N // K, axis=1)
    s = np.einsum("rnd,snd->rns", qr, kk) * scale
    if causal:
        cols = np.arange(kk.shape[0])
        s = np.where(cols[None, None, :] <= np.asarray(rows)[:, None, None], s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("rns,snd->rnd", p, vv)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--s", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--impl", default="cute")
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    S, N, K, D = a.s, a.heads, a.kv_heads, a.d
    causal = bool(a.causal)
    ks = jax.random.split(jax.random.key(int(time.time())), 4)
    q = jax.random.normal(ks[0], (1, S, N, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, S, K, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, K, D), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (1, S, N, D), jnp.float32).astype(jnp.bfloat16)
    scale = 1.0 / np.sqrt(D)

    def f(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jaxflash.flash_attention(
            q, k, v, is_causal=causal, implementation=a.impl), q, k, v)
        return (out,) + vjp(do)

    step = jax.jit(f)
    dev = jax.devices()[0]
    before = (dev.memory_stats() or {}).get("peak_bytes_in_use")
    t0 = time.perf_counter()
    out, dq, dk, dv = jax.block_until_ready(step(q, k, v, do))
    first_s = time.perf_counter() - t0
    stats = dev.memory_stats() or {}
    timing = time_throughput(step, (q, k, v, do), reps=a.reps, min_rep_s=0.0, max_n=1)
    io_bytes = sum(x.size * x.dtype.itemsize for x in (q, k, v, do, out, dq, dk, dv))
    finite = {n: bool(jnp.isfinite(x.astype(jnp.float32)).all())
              for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    norms = {n: float(jnp.linalg.norm(x.astype(jnp.float32)))
             for n, x in (("dq", dq), ("dk", dk), ("dv", dv))}
    rows = sorted(r for r in {0, 1, 777, S // 2 + 3, S - 2, S - 1} if 0 <= r < S)
    ref = _rows_reference(q, k, v, rows, scale, causal)
    got = np.asarray(out[0, rows].astype(jnp.float32), np.float64)
    rel_rows = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    flops = 4 * N * S * S * D / (2 if causal else 1) * 3.5
    problem = dict(B=1, T=S, S=S, N=N, K=K, D=D, causal=causal, dtype="bfloat16")
    res = {
        "env": envinfo.collect(), "problem": problem, "impl": a.impl,
        "explain": str(jaxflash.explain(q, k, v, is_causal=causal, implementation=a.impl)),
        "first_call_s": round(first_s, 3), "fwdbwd_ms": timing.median_s * 1e3,
        "tflops": flops / timing.median_s / 1e12,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "peak_before": before,
        "inputs_outputs_bytes": io_bytes, "finite": finite, "grad_norms": norms,
        "rel_l2_out_rows_vs_float64": rel_rows, "rows_checked": rows,
        "ok": bool(all(finite.values()) and all(x > 0 for x in norms.values())
                   and rel_rows < 2e-2),
    }
    print(json.dumps({k: v for k, v in res.items() if k != "env"}, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
