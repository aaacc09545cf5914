"""The ``precision="fp8"`` prologue on the H200: each implementation of `jaxflash.fp8.prologue`
(random-sign Hadamard on Q and K, 128-row block amax scales, E4M3 codes for Q, K, V) timed
alone against the memory bound, its codes checked against the reference bit for bit on the
GPU, then ``precision="fp8"`` end to end with each prologue beside our bf16 forward and the
FP8 kernel alone on pre-quantized operands.

    python -m benchmarks.fp8_prologue_bench build [--causal] [--out .device/kernels]   # here
    python -m benchmarks.fp8_prologue_bench run [--causal] [--no-e2e | --e2e-only] [--out DIR]

Grid (fp8_bench's): B * S = 16384, N * D = 2048, D 64 / 128 / 256, S 1k / 4k / 16k, dense;
the end-to-end part runs at S 4k / 16k (``--causal`` adds the causal points). Bytes moved by
the prologue: Q, K, V read once in bf16 and written once in E4M3 (3 B / element, scales
negligible); GB/s = that / time, beside the bound (H200 HBM3e, 4.8 TB/s). Candidates:
``reference`` (`jaxflash.quantize` as written: the code before the prologue module), ``xla``
(the fused arrangement), ``triton`` (the Pallas kernel as the library tiles it; at S = 4k also
``xla_dot``: not the library's, the Hadamard as a bf16 GEMM, whose codes differ from the rules
where its sums round differently), ``triton_gemm`` (the kernel with that tensor-core Hadamard;
at S = 4k also other tilings of it, ``triton_gemm_<warps>w_<columns>c_<rows>r``).
Results: ``fp8-prologue-bench[-alone|-e2e]-h200-<date>.json`` / ``.md`` in --out (default $OUT
or benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

GRID = [(d, s) for d in (64, 128, 256) for s in (1024, 4096, 16384)]
E2E_S = (4096, 16384)   # the target: precision="fp8" >= 1.25x bf16 at S >= 4k
HBM_BPS = 4.8e12
# Tilings of the tensor-core Hadamard (``triton_gemm``) tried beside the library's
# (`prologue.GEMM_CONFIG`) at S = 4k: (num_warps, output columns per product, rows per pass).
# The butterfly kernel's tilings were swept before (fp8-prologue-bench-h200-*b.md).
SWEEP = {64: [(4, 64, 128), (4, 64, 64), (16, 64, 128)],
         128: [(8, 64, 128), (8, 128, 128), (4, 32, 128), (16, 64, 128)],
         256: [(8, 128, 128), (16, 64, 128), (8, 32, 128), (4, 64, 64), (16, 128, 128)]}
# Tilings of the operand without the Hadamard (V; `prologue.PLAIN_CONFIG`), timed with Q and K
# at the library's tiling: (num_warps, columns per tile, rows per pass).
SWEEP_PLAIN = {64: [(4, 64, 128), (8, 64, 128), (2, 64, 64)],
               128: [(4, 128, 128), (8, 128, 128), (4, 64, 128), (4, 128, 64)],
               256: [(8, 256, 128), (8, 128, 128), (4, 256, 64), (8, 64, 128)]}
SWEEP_S = 4096


TOKENS = 16384  # B * S (`--tokens` shrinks it for a CPU smoke run of the prologue part)


def shapes(d, s):
    return max(TOKENS // s, 1), s, 2048 // d, d  # B, S, N, D


def build(out: str, causal: bool) -> int:
    """Compile the CuTe forward variants the end-to-end part runs (bf16, FP8 with block scales,
    precision="fp8") for the grid."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["JAXFLASH_PLATFORM"] = "cuda"
    os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import aot
    sds = jax.ShapeDtypeStruct
    launches = {}
    for d, s in GRID:
        B, S, N, D = shapes(d, s)
        for c in ((False, True) if causal else (False,)):
            xb = sds((B, S, N, D), jnp.bfloat16)
            x8 = sds((B, S, N, D), jnp.float8_e4m3fn)
            sc = sds((B, N, S // 128), jnp.float32)
            for plan in (jaxflash.explain(xb, xb, xb, is_causal=c, implementation="cute"),
                         jaxflash.explain(xb, xb, xb, is_causal=c, precision="fp8",
                                          implementation="cute"),
                         jaxflash.explain(x8, x8, x8, q_scale=sc, k_scale=sc, v_scale=sc,
                                          is_causal=c, implementation="cute")):
                launches.setdefault(plan.detail.fwd.name, plan.detail.fwd)
    # tests/fp8/test_prologue_gpu.py's end-to-end case
    xt = sds((2, 1024, 4, 128), jnp.bfloat16)
    plan = jaxflash.explain(xt, xt, xt, is_causal=True, precision="fp8", implementation="cute")
    launches.setdefault(plan.detail.fwd.name, plan.detail.fwd)
    counts = aot.build(list(launches.values()), out, progress=True)
    print(f"{counts['built']} built, {counts['kept']} up to date in {out}")
    return 0


def _prologue_fns(D, sweep: bool):
    """name -> jitted (q, k, v) -> the three (codes, scales), one per candidate."""
    import jax
    import jax.numpy as jnp

    from jaxflash import quantize as Q
    from jaxflash.fp8 import prologue as P
    from jaxflash.fp8 import prologue_triton as T
    signs = Q.hadamard_signs(0, D)
    e4 = jnp.float8_e4m3fn

    def make(one):
        return jax.jit(lambda q, k, v: (one(q, signs), one(k, signs), one(v, None)))

    def xla_dot(x, s):
        # Not the library's: the Hadamard as one bf16 dot with the signs folded into H (float32
        # accumulation in the GEMM's order, not the butterflies'): its `!n` column counts what
        # adopting it would change in the codes (the rule would have to change with it).
        if s is not None:
            h = Q.signed_hadamard_matrix(s).astype(jnp.bfloat16)
            y = jnp.einsum("blhd,de->blhe", x, h, preferred_element_type=jnp.float32)
            x = (y * jnp.float32(1.0 / math.sqrt(D))).astype(x.dtype)
        return P._xla(x, e4, 128, None)

    fns = {"reference": make(lambda x, s: P._reference(x, e4, 128, s)),
           "xla": make(lambda x, s: P._xla(x, e4, 128, s)),
           "xla_dot": make(xla_dot)} if sweep else {
               "reference": make(lambda x, s: P._reference(x, e4, 128, s)),
               "xla": make(lambda x, s: P._xla(x, e4, 128, s))}
    fns["triton"] = make(lambda x, s: P._triton(x, e4, 128, s))
    fns["triton_gemm"] = make(lambda x, s: P._triton_gemm(x, e4, 128, s))
    for w, c, r in (SWEEP[D] if sweep else ()):
        if (w, c, r) != P.GEMM_CONFIG[D]:
            fns[f"triton_gemm_{w}w_{c}c_{r}r"] = make(
                lambda x, s, w=w, c=c, r=r: T.quantize_blocks(
                    x, s, dtype=jnp.dtype(e4), block=128, num_warps=w, width=c, rows=r,
                    gemm=True) if s is not None else P._triton_gemm(x, e4, 128, None))
    for w, c, r in (SWEEP_PLAIN[D] if sweep else ()):
        if (w, c, r) != P.PLAIN_CONFIG[D]:
            fns[f"triton_v_{w}w_{c}c_{r}r"] = make(
                lambda x, s, w=w, c=c, r=r: P._triton_gemm(x, e4, 128, s) if s is not None
                else T.quantize_blocks(x, None, dtype=jnp.dtype(e4), block=128, num_warps=w,
                                       width=c, rows=r))
    return fns


def _adopt_fastest(row, D) -> dict:
    """``--adopt``: set `prologue`'s tilings at head dim `D` to the sweep's fastest candidates
    with no differing code (Q / K's tensor-core product and V's), before the end-to-end part
    runs; returns what was taken."""
    from jaxflash.fp8 import prologue as P
    base = row.get("triton_gemm_us")
    picked = {}
    for prefix, table in (("triton_gemm_", P.GEMM_CONFIG), ("triton_v_", P.PLAIN_CONFIG)):
        best, best_us = None, base
        for k, us in row.items():
            name = k[:-3]
            if (k.endswith("_us") and name.startswith(prefix) and name[len(prefix):][:1].isdigit()
                    and not row.get(name + "_mismatch") and best_us and us < best_us):
                best, best_us = name, us
        if best:
            w, c, r = (int(x[:-1]) for x in best[len(prefix):].split("_"))
            table[D] = (w, c, r)
            picked[prefix + "config"] = [w, c, r]
    return picked


def _mismatches(got, want) -> int:
    """Codes and scales that differ bitwise (NaN never occurs on these inputs)."""
    import jax.numpy as jnp
    n = 0
    for (g8, gs), (w8, ws) in zip(got, want):
        n += int(jnp.sum(jax_bits(g8) != jax_bits(w8)))
        n += int(jnp.sum(jax_bits(gs) != jax_bits(ws)))
    return n


def jax_bits(x):
    import jax
    import jax.numpy as jnp
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 4: jnp.uint32}[x.dtype.itemsize])


def run(out_dir: str, causal: bool, e2e: bool, prologue: bool = True,
        adopt: bool = False) -> int:
    import jax
    import jax.numpy as jnp

    import jaxflash
    from benchmarks import envinfo
    from benchmarks.timing import time_interleaved
    from jaxflash import quantize as Q
    from jaxflash.fp8 import prologue as P
    os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")
    rows, e2e_rows = [], []
    env = envinfo.collect()       # once: it runs nvidia-smi and git
    for d, s in GRID:
        B, S, N, D = shapes(d, s)
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(kk, (B, S, N, D), jnp.bfloat16) for kk in ks)
        q = q.at[..., 3].multiply(30.0)          # an outlier channel, as FA3's benchmark has
        nbytes = 3 * q.size * (2 + 1)
        fns = _prologue_fns(D, s == SWEEP_S) if prologue else {}
        ok, outs = {}, {}
        for name, f in fns.items():
            try:
                outs[name] = jax.block_until_ready(f(q, k, v))
                ok[name] = f
            except Exception as e:  # noqa: BLE001
                print(f"d{d} s{s} {name}: failed: {type(e).__name__}: {str(e)[:400]}")
        t = time_interleaved(ok, (q, k, v), reps=5, min_rep_s=0.02) if ok else {}
        row = dict(D=d, S=s, B=B, N=N, bytes=nbytes, bound_us=nbytes / HBM_BPS * 1e6)
        for name in fns:
            if name not in ok:
                row[name + "_failed"] = True
            if name in t:
                row[name + "_us"] = t[name].median_s * 1e6
                row[name + "_gbps"] = nbytes / t[name].median_s / 1e9
                row[name + "_mismatch"] = (0 if name == "reference" else
                                           _mismatches(outs[name], outs["reference"]))
        if adopt and s == SWEEP_S and fns:
            row["adopted"] = _adopt_fastest(row, D)
        if fns:
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(out_dir, env, rows, e2e_rows, prologue, e2e)
        if not e2e or s not in E2E_S:
            continue
        q8, qs = Q.quantize(q, jnp.float8_e4m3fn)
        k8, kss = Q.quantize(k, jnp.float8_e4m3fn)
        v8, vs = Q.quantize(v, jnp.float8_e4m3fn)
        for c in ((False, True) if causal else (False,)):
            args = (q, k, v, q8, k8, v8, qs, kss, vs)
            fe = {"bf16": jax.jit(lambda q, k, v, *_: jaxflash.flash_attention(
                      q, k, v, is_causal=c, implementation="cute")),
                  "fp8_kernel": jax.jit(lambda q, k, v, q8, k8, v8, qs, ks, vs:
                      jaxflash.flash_attention(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs,
                                               is_causal=c, implementation="cute"))}
            oke = {}
            for name, f in fe.items():
                try:
                    jax.block_until_ready(f(*args))
                    oke[name] = f
                except Exception as e:  # noqa: BLE001
                    print(f"d{d} s{s} c{int(c)} {name}: failed: {type(e).__name__}: "
                          f"{str(e)[:300]}")
            for impl in P.IMPLS:
                # The prologue is picked when the call is traced: trace each under its pick.
                f = jax.jit(lambda q, k, v, *_: jaxflash.flash_attention(
                    q, k, v, is_causal=c, precision="fp8", implementation="cute"))
                saved, P.IMPL = P.IMPL, impl
                try:
                    jax.block_until_ready(f(*args))
                    oke["e2e_" + impl] = f
                except Exception as e:  # noqa: BLE001
                    print(f"d{d} s{s} c{int(c)} e2e {impl}: failed: {type(e).__name__}: "
                          f"{str(e)[:300]}")
                finally:
                    P.IMPL = saved
            te = time_interleaved(oke, args, reps=5, min_rep_s=0.02) if oke else {}
            fl = 4.0 * B * N * S * S * D / (2 if c else 1)
            er = dict(D=d, S=s, causal=c)
            for name in oke:
                er[name] = fl / te[name].median_s / 1e12
                er[name + "_ms"] = te[name].median_s * 1e3
            e2e_rows.append(er)
            print(json.dumps(er), flush=True)
            _write(out_dir, env, rows, e2e_rows, prologue, e2e)
    print(_write(out_dir, env, rows, e2e_rows, prologue, e2e))
    return 0


def _write(out_dir, env, rows, e2e_rows, prologue, e2e) -> str:
    """The results so far as JSON and a table (after every row: a run cut short keeps them)."""
    date = datetime.date.today().isoformat()
    os.makedirs(out_dir, exist_ok=True)
    part = "" if prologue and e2e else ("-alone" if prologue else "-e2e")
    base = os.path.join(out_dir, f"fp8-prologue-bench{part}-h200-{date}")
    summary = _summary(e2e_rows)
    with open(base + ".json", "w") as f:
        json.dump({"env": env, "prologue": rows, "e2e": e2e_rows,
                   "summary": summary}, f, indent=1)
    text = _table(rows, e2e_rows, summary)
    with open(base + ".md", "w") as f:
        f.write(text)
    return text


def _summary(e2e_rows):
    out = {}
    for impl in ("reference", "xla", "triton", "triton_gemm"):
        r = [x[f"e2e_{impl}"] / x["bf16"] for x in e2e_rows
             if x["S"] >= 4096 and x.get(f"e2e_{impl}") and x.get("bf16")]
        out[f"min_e2e_{impl}_vs_bf16_S>=4k"] = min(r) if r else None
        out[f"geomean_e2e_{impl}_vs_bf16_S>=4k"] = (math.exp(sum(map(math.log, r)) / len(r))
                                                   if r else None)
    out["target_e2e_vs_bf16"] = 1.25
    return out


def _table(rows, e2e_rows, summary):
    f0 = lambda x: "" if x is None else f"{x:.0f}"
    f2 = lambda x: "" if x is None else f"{x:.2f}"
    names = list(dict.fromkeys(k[:-5] for r in rows for k in r if k.endswith("_gbps")))
    lines = [] if not rows else [
        "Prologue alone (Q, K with Hadamard, V; E4M3, 128-row block scales): us (GB/s), "
        "bound at 4.8 TB/s; `!n` = n codes / scales differ from the reference", "",
        "| D | S | bound us | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            if n + "_us" not in r:   # not run at this point (the sweep is at one length)
                cells.append("failed" if r.get(n + "_failed") else "")
                continue
            mm = r.get(n + "_mismatch", 0)
            cells.append(f"{r[n + '_us']:.0f} ({r[n + '_gbps']:.0f})" + (f" !{mm}" if mm else ""))
        lines.append(f"| {r['D']} | {r['S']} | {r['bound_us']:.0f} | " + " | ".join(cells) + " |")
    adopted = [f"hd {r['D']}: {r['adopted']}" for r in rows if r.get("adopted")]
    if adopted:
        lines += ["", "Tilings the end-to-end part ran (--adopt; (warps, columns, rows)): "
                  + "; ".join(adopted)]
    if e2e_rows:
        en = ["bf16", "fp8_kernel", "e2e_reference", "e2e_xla", "e2e_triton", "e2e_triton_gemm"]
        lines += ["", "End to end, TFLOP/s (ms): precision=\"fp8\" from bf16 with each prologue",
                  "", "| D | S | causal | " + " | ".join(en) + " | best e2e / bf16 |",
                  "|---|---|---|" + "---|" * (len(en) + 1)]
        for r in e2e_rows:
            best = max([r[n] for n in en[2:] if r.get(n)], default=None)
            lines.append(f"| {r['D']} | {r['S']} | {int(r['causal'])} | " + " | ".join(
                f"{f0(r.get(n))} ({r[n + '_ms']:.2f})" if r.get(n) else "" for n in en)
                + f" | {f2(best / r['bf16'] if best and r.get('bf16') else None)} |")
        lines += ["", ", ".join(f"{k}: {f2(v) if isinstance(v, float) else v}"
                                for k, v in summary.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("build", "run"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--causal", action="store_true", help="add causal end-to-end points")
    ap.add_argument("--no-e2e", action="store_true", help="the prologue alone only")
    ap.add_argument("--e2e-only", action="store_true", help="the end-to-end part only")
    ap.add_argument("--tokens", type=int, default=16384, help="B * S (smaller: a smoke run)")
    ap.add_argument("--grid", default=None, help="points D:S,D:S,... (default: the full grid)")
    ap.add_argument("--adopt", action="store_true",
                    help="the end-to-end part runs the sweep's fastest exact tilings (recorded "
                         "in the row's 'adopted')")
    ap.add_argument("--no-sweep", action="store_true",
                    help="leave out the tilings tried beside the library's (their compiles "
                         "take minutes)")
    a = ap.parse_args(argv)
    global TOKENS, GRID, SWEEP_S
    TOKENS = a.tokens
    if a.no_sweep:
        SWEEP_S = None
    if a.grid:
        GRID = [tuple(int(x) for x in p.split(":")) for p in a.grid.split(",")]
    if a.mode == "build":
        return build(a.out or ".device/kernels", a.causal)
    return run(a.out or os.environ.get("OUT") or "benchmarks/results", a.causal, not a.no_e2e,
               not a.e2e_only, a.adopt)


if __name__ == "__main__":
    sys.exit(main())
