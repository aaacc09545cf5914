"""Turn a results JSON of benchmarks/bench.py into markdown (tables for the README).

    python -m benchmarks.report benchmarks/results/h200-2026-11-30.json [-o out.md]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Column order: ours first, then the peers.
ORDER = ("cute", "pallas", "xla", "cudnn", "pallas-triton", "tokamax", "jax-xla")
OURS = ("cute", "pallas")  # the ratio columns: our fast paths vs cuDNN
MODE_TITLE = {"fwd": "forward", "fwdbwd": "forward+backward"}


def row_line(r) -> str:
    """One progress line for the console."""
    head = (f"{r['impl']:14s} {r['mode']:7s} D={r['D']:<3d} S={r['S']:<6d} "
            f"causal={r['causal']} B={r['B']} N={r['N']}")
    if r["status"] == "ok":
        tf = f"{r['tflops']:7.1f} TFLOP/s" if r.get("tflops") is not None else ""
        err = ""
        if r.get("rel_l2") is not None:
            err = f" rel-L2 vs {r['check_against']} {r['rel_l2']:.2e}"
        return f"{head} {r['ms']:9.4f} ms {tf}{err}"
    return f"{head} {r['status'].upper()}: {r.get('error') or ''}"[:400]


def _impls(rows):
    present = {r["impl"] for r in rows}
    return [i for i in ORDER if i in present] + sorted(present - set(ORDER))


def _points(rows, mode):
    seen = []
    for r in rows:
        if r["mode"] == mode:
            k = (r["D"], r["S"], r["causal"])
            if k not in seen:
                seen.append(k)
    return sorted(seen)


def _index(rows):
    return {(r["impl"], r["mode"], r["D"], r["S"], r["causal"]): r for r in rows}


def _cell(r):
    if r is None:
        return ""
    if r["status"] == "ok":
        t = r["tflops"]
        return f"{t:.0f}" if t >= 10 else f"{t:.3g}"
    return {"wrong": "WRONG", "error": "err", "skipped": "–"}.get(r["status"], r["status"])


def ratio(a, b):
    if (a is None or b is None or a["status"] != "ok" or b["status"] != "ok"
            or not a.get("tflops") or not b.get("tflops")):
        return None
    return a["tflops"] / b["tflops"]


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def mode_table(rows, mode):
    """Markdown lines: one row per (D, S, causal), TFLOP/s per implementation, ours / cuDNN."""
    idx = _index(rows)
    names = [i for i in _impls([r for r in rows if r["mode"] == mode])]
    ours = [i for i in names if i in OURS] if "cudnn" in names else []
    head = ["D", "S", "causal"] + names + [f"{o}/cuDNN" for o in ours]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = {o: [] for o in ours}
    for (D, S, c) in _points(rows, mode):
        cells = [str(D), str(S), str(c)]
        cells += [_cell(idx.get((n, mode, D, S, c))) for n in names]
        for o in ours:
            x = ratio(idx.get((o, mode, D, S, c)), idx.get(("cudnn", mode, D, S, c)))
            ratios[o].append(x)
            cells.append("" if x is None else f"{x:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for o in ours:
        g = geomean(ratios[o])
        n = sum(x is not None for x in ratios[o])
        if g is not None:
            notes.append(f"{o}/cuDNN geometric mean over {n} points: **{g:.3f}**")
    return lines, notes


def latency_table(rows):
    lat = [r for r in rows if r["mode"] == "latency"]
    if not lat:
        return []
    cud = next((r for r in lat if r["impl"] == "cudnn" and r["status"] == "ok"), None)
    lines = ["| implementation | median µs/call | min µs | vs cuDNN |", "|---|---|---|---|"]
    for name in _impls(lat):
        r = next(x for x in lat if x["impl"] == name)
        if r["status"] == "ok":
            vs = f"{r['ms'] / cud['ms']:.2f}" if cud else ""
            lines.append(f"| {name} | {r['ms'] * 1e3:.1f} | {r['ms_min'] * 1e3:.1f} | {vs} |")
        else:
            lines.append(f"| {name} | {_cell(r)} | | |")
    return lines


def check_summary(rows):
    """Worst errors per implementation and mode: the evidence that timed kernels were right."""
    lines = ["| implementation | mode | worst rel-L2 vs baseline | worst rel-L2 vs float32 "
             "(sampled rows) | points checked | wrong |", "|---|---|---|---|---|---|"]
    for name in _impls(rows):
        for mode in ("fwd", "fwdbwd", "latency"):
            rs = [r for r in rows if r["impl"] == name and r["mode"] == mode
                  and r["status"] in ("ok", "wrong")]
            if not rs:
                continue
            rel = [r["rel_l2"] for r in rs if r.get("rel_l2") is not None]
            ref = [r["ref_err"] for r in rs if r.get("ref_err") is not None]
            base = sorted({r["check_against"] for r in rs if r.get("check_against")})
            lines.append(f"| {name} | {mode} | "
                         f"{(f'{max(rel):.1e} ({chr(44).join(base)})') if rel else '–'} | "
                         f"{f'{max(ref):.1e}' if ref else '–'} | {len(rs)} | "
                         f"{sum(r['status'] == 'wrong' for r in rs)} |")
    return lines


def failures(rows):
    """Distinct error texts per implementation, with the points where each occurred."""
    groups = {}
    for r in rows:
        if r["status"] in ("error", "wrong", "skipped") and r.get("error"):
            k = (r["impl"], r["status"], r["error"][:300])
            groups.setdefault(k, []).append(f"{r['mode']} D{r['D']} S{r['S']} c{r['causal']}")
    lines = []
    for (impl, status, err), where in groups.items():
        pts = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
        lines.append(f"- **{impl}** {status} at {pts}: `{err}`")
    return lines


def markdown(data) -> str:
    env, cfg, rows = data["env"], data.get("config", {}), data["rows"]
    out = [f"### Attention benchmark: {env.get('device')} ({env.get('platform')}), "
           f"{env.get('date_utc')}", ""]
    vers = [f"jax {env.get('jax')}", f"jaxlib {env.get('jaxlib')}"]
    for k in ("cudnn", "cuda_plugin", "cutlass_dsl", "tokamax"):
        if env.get(k):
            vers.append(f"{k} {env[k]}" if k == "cudnn" else str(env[k]))
    out.append(f"Versions: {', '.join(vers)}; jaxflash {env.get('jaxflash')} "
               f"(commit {env.get('commit')}).")
    if env.get("nvidia_smi"):
        out.append(f"GPU: {env['nvidia_smi']}.")
    if isinstance(env.get("matmul_bf16_tflops"), (int, float)):
        out.append(f"bf16 8192³ matmul in the same run: {env['matmul_bf16_tflops']} TFLOP/s.")
    out.append(f"bf16, B·S = {cfg.get('tokens')}, N·D = {cfg.get('hidden')}; TFLOP/s = "
               f"4·B·N·S²·D (÷2 causal), ×3.5 for forward+backward; median of "
               f"{cfg.get('reps')} reps. Cells: TFLOP/s; WRONG = failed the output check (not "
               f"timed); err = could not run (below); – = skipped.")
    out.append("")
    for mode in ("fwd", "fwdbwd"):
        if not any(r["mode"] == mode for r in rows):
            continue
        lines, notes = mode_table(rows, mode)
        out += [f"#### {MODE_TITLE[mode]} (TFLOP/s)", ""] + lines + [""]
        if notes:
            out += ["; ".join(notes) + ".", ""]
    lat = latency_table(rows)
    if lat:
        out += ["#### Small call: B=1, N=1, T=S=128, D=64, forward, wall time per call "
                "(dispatch included)", ""] + lat + [""]
    out += ["#### Output checks", ""] + check_summary(rows) + [""]
    fl = failures(rows)
    if fl:
        out += ["#### Could not run / skipped", ""] + fl + [""]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description="results JSON -> markdown")
    p.add_argument("json")
    p.add_argument("-o", "--out", default=None, help="write here (default: print)")
    a = p.parse_args(argv)
    with open(a.json) as f:
        text = markdown(json.load(f))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
