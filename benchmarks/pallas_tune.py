"""Device run for the Pallas fallback: check the Triton lowering against the reference, then time
it beside cuDNN and JAX's Pallas-Triton op, and try a few block configs.

    python benchmarks/pallas_tune.py --out DIR [--budget SECONDS]

Writes DIR/pallas-h200.json after every row (so a run cut short keeps what it measured).
Timing: a host timer around `n` back-to-back calls, synchronized, after two warm-up calls;
median of `reps` such batches (the method of ../shared/anchors/anchors_bench.py, so numbers are
comparable with the anchors). TFLOP/s = 4*B*H*S^2*D fwd, halved if causal, x3.5 for fwd+bwd.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash import pallas_fallback  # noqa: E402
from jaxflash.pallas_fallback import config as pcfg  # noqa: E402
from benchmarks.timing import time_throughput  # noqa: E402

T0 = time.time()
RES = {"rows": [], "checks": [], "tune": [], "env": {}}


def save(out):
    with open(os.path.join(out, "pallas-h200.json"), "w") as f:
        json.dump(RES, f, indent=1)


def bench(f, *args, reps=5):
    """Median seconds per call (the harness's own throughput timing, `benchmarks/timing.py`)."""
    return time_throughput(f, args, reps=reps, warmup=2).median_s


def flops(B, H, S, D, causal, mode):
    f = 4 * B * H * S * S * D / (2 if causal else 1)
    return f * (1 if mode == "fwd" else 3.5)


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    fin = np.isfinite(b)
    if np.any(np.isnan(a)):
        return float("nan")
    return float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def check(name, B, T, S, N, K, H, Hv=None, dtype=jnp.bfloat16, bias_shape=None, **kw):
    """Pallas (Triton) vs the float32 reference: out, lse, dq, dk, dv (and dbias)."""
    Hv = Hv or H
    ks = jax.random.split(jax.random.key(hash(name) % 2**31), 6)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, Hv), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[3], (B, T, N, Hv), jnp.float32)
    bias = None if bias_shape is None else jax.random.normal(ks[4], bias_shape) * 0.5

    def run(impl, q, k, v, bias):
        def loss(q, k, v, bias):
            kk = dict(kw)
            if bias is not None:
                kk["bias"] = bias
            o, l = jaxflash.flash_attention(q, k, v, implementation=impl, return_residual=True,
                                            **kk)
            return jnp.sum(o.astype(jnp.float32) * w), (o, l)
        argn = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
        g, (o, l) = jax.jit(jax.grad(loss, argnums=argn, has_aux=True))(q, k, v, bias)
        return o, l, g

    t = time.time()
    try:
        o, l, g = run("pallas", q, k, v, bias)
        up = lambda x: x.astype(jnp.float32)
        ro, rl, rg = run("xla", up(q), up(k), up(v), bias)
        errs = {"out": rel(o, ro), "lse": rel(l, rl)}
        for nm, a, b in zip(("dq", "dk", "dv", "dbias"), g, rg):
            errs[nm] = rel(a, b)
        ok = all(np.isfinite(e) and e < (0.03 if dtype == jnp.bfloat16 else 2e-3)
                 for e in errs.values())
        row = dict(name=name, ok=bool(ok), errs=errs, secs=time.time() - t)
    except Exception as e:
        row = dict(name=name, ok=False, error=repr(e)[:800], secs=time.time() - t)
        traceback.print_exc()
    RES["checks"].append(row)
    print("CHECK", json.dumps(row), flush=True)


def mk(B, H, S, D, key=0):
    ks = jax.random.split(jax.random.key(key), 4)
    return [jax.random.normal(k_, (B, S, H, D), jnp.bfloat16) for k_ in ks]


def ours(config=None):
    from jaxflash._types import AttentionArrays, AttentionStatics

    def attn(q, k, v, causal):
        st = AttentionStatics(scale=1 / math.sqrt(q.shape[-1]), is_causal=causal)
        ar = AttentionArrays()

        @jax.custom_vjp
        def f(q, k, v):
            return pallas_fallback.forward(q, k, v, ar, st, config=config)[0]

        def f_fwd(q, k, v):
            o, l = pallas_fallback.forward(q, k, v, ar, st, config=config)
            return o, (q, k, v, o, l)

        def f_bwd(res, do):
            q, k, v, o, l = res
            dq, dk, dv, _, _ = pallas_fallback.backward(q, k, v, ar, st, o, l, do, config=config)
            return dq, dk, dv

        f.defvjp(f_fwd, f_bwd)
        return f(q, k, v)
    return attn


def impls():
    d = {"jaxflash-pallas": ours(),
         "cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(
             q, k, v, is_causal=c, implementation="cudnn")}
    try:
        from jax.experimental.pallas.ops.gpu import attention as pl_tri
        d["jax-pallas-triton-mha"] = lambda q, k, v, c: pl_tri.mha(
            q, k, v, segment_ids=None, causal=c, sm_scale=1 / math.sqrt(q.shape[-1]))
    except Exception as e:  # noqa: BLE001
        print("no jax pallas mha:", e)
    return d


def point(name, attn, B, H, S, D, causal, modes=("fwd", "fwd+bwd"), tag="rows", extra=None,
          ref=None):
    q, k, v, do = mk(B, H, S, D)
    for mode in modes:
        try:
            if mode == "fwd":
                f = jax.jit(lambda q, k, v: attn(q, k, v, causal))
            else:
                def loss(q, k, v):
                    return jnp.sum(attn(q, k, v, causal).astype(jnp.float32)
                                   * do.astype(jnp.float32))
                f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            t = bench(f, q, k, v)
            tf = flops(B, H, S, D, causal, mode) / t / 1e12
            row = dict(impl=name, B=B, H=H, S=S, D=D, causal=causal, mode=mode, ms=t * 1e3,
                       tflops=tf, **(extra or {}))
            if ref is not None and mode == "fwd+bwd":
                # Gradients against cuDNN's on the same inputs (rel. L2; bf16 noise ~3e-3).
                got = f(q, k, v)
                row["rel_l2_vs_cudnn"] = [rel(jnp.asarray(x, jnp.float32),
                                              jnp.asarray(y, jnp.float32))
                                          for x, y in zip(got, ref(q, k, v))]
        except Exception as e:  # noqa: BLE001
            row = dict(impl=name, B=B, H=H, S=S, D=D, causal=causal, mode=mode, ms=None,
                       tflops=None, error=repr(e)[:300], **(extra or {}))
        RES[tag].append(row)
        print(f"{tag:4s} {name:24s} S={S:6d} D={D:3d} c={int(causal)} {mode:7s} "
              f"{row['ms'] or float('nan'):8.3f} ms {row['tflops'] or float('nan'):6.1f} TF/s "
              f"{row.get('error', '')[:100]} {row.get('rel_l2_vs_cudnn', '')} {extra or ''}",
              flush=True)


BEST = {}  # head dim -> the config that won `tune_kernels` (used for the grid rows)

# Candidates per kernel: (block_q, block_k, num_warps, num_stages); the first is the table's.
CANDS = {
    128: dict(fwd=[(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3)],
              dkdv=[(32, 128, 8, 3), (32, 128, 4, 5), (64, 128, 8, 3), (16, 128, 4, 4),
                    (64, 64, 4, 3)],
              dq=[(128, 32, 8, 3), (128, 32, 4, 5), (128, 64, 8, 3), (64, 64, 4, 3),
                  (64, 32, 4, 4)]),
    256: dict(fwd=[(128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
              dkdv=[(32, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 3), (16, 64, 4, 3)],
              dq=[(64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 3), (64, 64, 8, 2)]),
}


def tune_kernels(left, D, S=16384):
    """Time each kernel alone per candidate at B*S=16k, H*D=2048, non-causal; keep the best
    of each (the passes are independent launches, so the best total is the best of each)."""
    from jaxflash._types import AttentionArrays, AttentionStatics
    from jaxflash.pallas_fallback import _compiler_params, _operands, _spec
    from jaxflash.pallas_fallback import bwd as B_
    from jaxflash.pallas_fallback import fwd as F_
    B, H = 16384 // S, 2048 // D
    q, k, v, do = mk(B, H, S, D)
    st = AttentionStatics(scale=1 / math.sqrt(D))
    ar = AttentionArrays()
    spec = _spec(q, k, v, ar, st)
    ops = _operands(ar, spec)
    base = pcfg.choose(D, D, "bfloat16", interpret=False)
    o, lse = jax.jit(lambda q, k, v: pallas_fallback.forward(q, k, v, ar, st))(q, k, v)
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    fl = 4 * B * H * S * S * D
    runners = {
        "fwd": (lambda pc: jax.jit(lambda q, k, v: F_.forward(
            q, k, v, ops, spec, pc, interpret=False,
            compiler_params=_compiler_params(pc, False))), (q, k, v), fl),
        "dkdv": (lambda pc: jax.jit(lambda q, k, v, do: B_.dkdv(
            q, k, v, do, lse, delta, ops, spec, pc, interpret=False,
            compiler_params=_compiler_params(pc, False))), (q, k, v, do), 1.5 * fl),
        "dq": (lambda pc: jax.jit(lambda q, k, v, do: B_.dq(
            q, k, v, do, lse, delta, ops, spec, pc, interpret=False,
            compiler_params=_compiler_params(pc, False))), (q, k, v, do), 1.25 * fl),
    }
    best = {}
    for kern, (make, args, kfl) in runners.items():
        for c in CANDS[D][kern]:
            if left() < 35:
                break
            pc = pcfg.PassConfig(*c)
            try:
                t = bench(make(pc), *args, reps=3)
                row = dict(kernel=kern, D=D, S=S, config=c, ms=t * 1e3, tflops=kfl / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row = dict(kernel=kern, D=D, S=S, config=c, ms=None, tflops=None,
                           error=repr(e)[:300])
            RES["tune"].append(row)
            print("tune", json.dumps(row), flush=True)
            if row["ms"] and (kern not in best or row["ms"] < best[kern][0]):
                best[kern] = (row["ms"], pc)
    BEST[D] = pcfg.Config(fwd=best.get("fwd", (0, base.fwd))[1],
                          dkdv=best.get("dkdv", (0, base.dkdv))[1],
                          dq=best.get("dq", (0, base.dq))[1], dbias=base.dbias)
    print("BEST", D, BEST[D], flush=True)


def cudnn_grads(causal, do):
    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda q, k, v: g(q, k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--checks", default="", help="comma-separated subset of the checks")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--skip-impl", nargs="*", default=[])
    ap.add_argument("--grid", default="", help="D:S:causal,... instead of the full grid")
    ap.add_argument("--reserve", type=float, default=30,
                    help="stop starting points when fewer seconds than this are left")
    a = ap.parse_args()
    sh = lambda c: subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    RES["env"] = dict(gpu=sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                      jax=jax.__version__, devices=str(jax.devices()),
                      timing="host timer around 10 calls after 2 warm-ups, median of 5")
    print(RES["env"], flush=True)
    left = lambda: a.budget - (time.time() - T0)

    if not a.skip_checks:
        CHECKS = [
            ("D64", lambda n: check(n, 2, 512, 512, 4, 4, 64)),
            ("D64-causal-gqa", lambda n: check(n, 2, 512, 384, 8, 2, 64, is_causal=True)),
            ("D128", lambda n: check(n, 2, 512, 512, 4, 4, 128)),
            ("D128-causal-gqa", lambda n: check(n, 2, 512, 384, 8, 2, 128, is_causal=True)),
            ("D256", lambda n: check(n, 2, 512, 512, 4, 4, 256)),
            ("D256-causal-gqa", lambda n: check(n, 2, 512, 384, 8, 2, 256, is_causal=True)),
            ("features-ragged", lambda n: check(
                n, 2, 300, 257, 4, 2, 96, Hv=64, bias_shape=(1, 4, 300, 257), softcap=20.0,
                alibi_slopes=jnp.linspace(0.01, 0.1, 4), local_window_size=(64, 16),
                is_causal=True, q_segment_ids=jnp.ones((2, 300), jnp.int32),
                kv_segment_ids=jnp.ones((2, 257), jnp.int32),
                key_value_seq_lengths=jnp.array([200, 257], jnp.int32),
                mask=jax.random.bernoulli(jax.random.key(5), 0.9, (2, 1, 300, 257)))),
            ("f32-mqa", lambda n: check(n, 1, 200, 200, 4, 1, 64, dtype=jnp.float32,
                                        is_causal=True)),
            ("f16-T1", lambda n: check(n, 2, 1, 129, 4, 4, 128, dtype=jnp.float16)),
            ("f16-D256-gqa", lambda n: check(n, 1, 200, 333, 4, 2, 256, dtype=jnp.float16,
                                             is_causal=True)),
        ]
        want = set(a.checks.split(",")) if a.checks else None
        for name, fn in CHECKS:
            if want is None or name in want:
                fn(name)
        save(a.out)

    im = impls()
    grid = [(128, 16384, False), (256, 16384, False), (128, 16384, True), (64, 16384, False),
            (128, 4096, False), (256, 4096, False)]
    grid += [(D, S, c) for D in (64, 128, 256) for S in (1024, 4096, 16384) for c in (False, True)
             if (D, S, c) not in grid]
    if a.grid:
        grid = [tuple(int(x) for x in g.split(":")) for g in a.grid.split(",")]
        grid = [(D, S, bool(c)) for D, S, c in grid]
    for gi, (D, S, causal) in enumerate(grid):
        if a.tune and D in CANDS and D not in BEST:
            try:
                tune_kernels(left, D)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        B, H = 16384 // S, 2048 // D
        for name, attn in im.items():
            if name in a.skip_impl:
                continue
            if name == "jax-pallas-triton-mha" and D == 256:
                continue  # that op refuses D=256 (shared memory), see the anchors
            if left() < a.reserve:
                print("budget spent; stopping", flush=True)
                save(a.out)
                return
            ref = None
            if name == "jaxflash-pallas":
                if D in BEST:
                    attn = ours(BEST[D])
                ref = cudnn_grads(causal, mk(B, H, S, D)[3])
            point(name, attn, B, H, S, D, causal, ref=ref,
                  extra=dict(config=str(BEST.get(D) or pcfg.choose(D, D, "bfloat16",
                                                                   interpret=False)))
                  if name == "jaxflash-pallas" else None)
        save(a.out)

    save(a.out)
    print("DONE", time.time() - T0, flush=True)


if __name__ == "__main__":
    main()
