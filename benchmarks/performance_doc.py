"""Regenerate docs/performance.md and its plots from the result files it cites.

    python -m benchmarks.performance_doc            # writes docs/performance.md, docs/img/*.png
    python -m benchmarks.performance_doc --check    # exit 1 if docs/performance.md is stale

Every figure on the page is read from the files named below, all in ``benchmarks/results/``;
nothing else is read. The output is deterministic: the same files give the same markdown byte
for byte (``--check`` compares only the markdown; the plots need matplotlib, the check does not).
To cite a newer run, put its file in ``benchmarks/results/``, change the name here, regenerate.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOC = os.path.join(ROOT, "docs", "performance.md")
IMG = os.path.join(ROOT, "docs", "img")

# -- the result files this page cites (all in benchmarks/results/) ------------------------------
GRID = "h200-2026-12-03-cc-b.json"           # latest grid: cute beside cuDNN, fwd and fwd+bwd
GRID_MD = "h200-2026-12-03-cc-b.md"         # ... as written by the bench, with its checks
GRID_ALL = "h200-2026-12-01-e.json"           # the grid with every implementation (Pallas)
FA4_FWD = "fa4-sm90-h200-2026-11-30.json"     # FlashAttention-4 sm90 forward (from the anchors)
FA4_FWDBWD = "fa4-sm90-fwdbwd-h200-2026-11-30.json"  # ... its forward+backward
BWD_BENCH = "h200-2026-12-02-cute-bwd-bench-dq4.json"  # backward kernel bench, D=256 picks
DETERMINISTIC = "cute-bwd-bench-dqa-h200-2026-12-01.json"  # deterministic=True against off
SEGMENTS = "cute-fwd-segbench-h200-2026-11-30.json"  # packed documents, ALiBi (forward)
LONG = "transcribed-h200-2026-11-30.json"     # 128k-token sequence, forward+backward
PALLAS = "pallas-h200-2026-11-30.json"        # Pallas fallback beside JAX's Pallas-Triton op
RING = ("ring-pallas-h200x2-2026-11-30.json", "ring-cute-h200x2-2026-11-30.json")
LM = "lm-compare-cute-h200-2026-12-02-s6.json"  # training-loss check, example LM
FP8_BENCH = "fp8-fwd-bench-h200-2026-12-05.json"  # FP8 forward beside bf16 and cuDNN FP8
FP8_FWDBWD = ("fp8-fwdbwd-bench-d64-h200-2026-12-04f.json",  # FP8 forward + backward, one
              "fp8-fwdbwd-bench-h200-2026-12-05.json",       # device call per head dim
              "fp8-fwdbwd-bench-d256-h200-2026-12-04f.json")
FP8_DIAG = "fp8-fwd-diag-h200-2026-12-04.json"    # FP8 variants, and without V's transpose
FP8_E2E = "fp8-prologue-bench-h200-2026-12-04c.json"  # precision="fp8" with each prologue
MODS = "mods-bench-h200-2026-12-04b.json"          # the mods on cute / Pallas / cuDNN
MODS_FWDBWD = "mods-bench-fwdbwd-h200-2026-12-04.json"  # ... their forward + backward rows
MODS_KERNEL = "mods-kernel-bench-h200-2026-12-04d.json"  # mods against the built-ins
MODS_SCHED = "mods-schedules-h200-2026-12-04.json"  # the sparse calls under each schedule
SOURCES = (GRID, GRID_MD, GRID_ALL, FA4_FWD, FA4_FWDBWD, BWD_BENCH, DETERMINISTIC, SEGMENTS, LONG,
           PALLAS) + RING + (LM, FP8_BENCH) + FP8_FWDBWD + (FP8_DIAG, MODS, MODS_FWDBWD,
                                                            MODS_KERNEL, MODS_SCHED)

# The two FA4 files are copies of ../shared/anchors/*.json, which hold rows only; their run is
# described in that directory's README (H200, jax 0.11.2, cuDNN 9.19, fa4-jax 0.1.0's vendored
# FlashAttention-4 sm90 kernels compiled for sm_90a and run through XLA FFI, 2026-11-30).
ANCHOR_ENV = {"device": "NVIDIA H200", "date": "2026-11-30",
              "versions": "jax 0.11.2, cuDNN 9.19, FlashAttention-4 sm90 kernels of fa4-jax 0.1.0"}

POINTS = [(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (0, 1)]
MODES = ("fwd", "fwdbwd")
MODE_NAME = {"fwd": "forward", "fwdbwd": "forward+backward"}


# -- reading ------------------------------------------------------------------------------------
def load(name: str):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def kfmt(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def table(head, rows) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def grid_env(data) -> str:
    e = data["env"]
    gpu = e["nvidia_smi"].split("\n")[0].split(", ")
    return (f"{e['device']} (driver {gpu[1]}, {gpu[2]}), {e['date_utc'][:10]}, jax {e['jax']}, "
            f"{e['cuda_plugin']}, cuDNN {e['cudnn']}")


def bench_env(data) -> str:
    """The kernel benches record GPU, date, jax and Python."""
    return f"{data['gpu']}, {data['date']}, jax {data['jax']}, Python {data['python']}"


def grid_index(data, impls=("cute", "cudnn")):
    """{(impl, mode, D, S, causal): TFLOP/s} of the rows that ran and passed their check."""
    return {(r["impl"], r["mode"], r["D"], r["S"], r["causal"]): r["tflops"]
            for r in data["rows"] if r["status"] == "ok" and r["impl"] in impls
            and r["mode"] in MODES}


def fa4_index():
    """{(mode, D, S, causal): (FA4 TFLOP/s, cuDNN TFLOP/s in FA4's run)}."""
    out = {}
    for r in load(FA4_FWD):
        out[("fwd", r["D"], r["S"], r["causal"])] = (r["fa4_tflops"], r["cudnn_tflops"])
    for r in load(FA4_FWDBWD):
        out[("fwdbwd", r["D"], r["S"], r["causal"])] = (r["fa4_fwdbwd_tflops"],
                                                         r["cudnn_fwdbwd_tflops"])
    return out


# -- the numbers the page and the plots share ---------------------------------------------------
def grid_numbers():
    data = load(GRID)
    g, fa4 = grid_index(data), fa4_index()
    rows = {}
    for mode in MODES:
        for (d, s, c) in POINTS:
            ours, cud = g[("cute", mode, d, s, c)], g[("cudnn", mode, d, s, c)]
            f, fc = fa4[(mode, d, s, c)]
            rows[(mode, d, s, c)] = dict(ours=ours, cudnn=cud, vs_cudnn=ours / cud, fa4=f,
                                         vs_fa4=ours / f, vs_fa4_norm=(ours / cud) / (f / fc))
    return data, rows


def summary_table(rows) -> list[str]:
    """Geometric means per head dim over S 1k / 4k / 16k, dense and causal."""
    out = []
    for label, ds in (("64", (64,)), ("128", (128,)), ("256", (256,)), ("all 18 points",
                                                                          (64, 128, 256))):
        cells = [label]
        for mode in MODES:
            sel = [rows[(mode, d, s, c)] for (d, s, c) in POINTS if d in ds]
            cells += [f"{geomean([r['vs_cudnn'] for r in sel]):.2f}×",
                      f"{geomean([r['vs_fa4'] for r in sel]):.2f}×"]
        out.append(cells)
    return table(["D", "forward vs cuDNN", "forward vs FA4", "fwd+bwd vs cuDNN",
                  "fwd+bwd vs FA4"], out)


# -- sections -----------------------------------------------------------------------------------
def section_summary(data, rows) -> list[str]:
    lo = {m: min(rows[(m, *p)]["vs_cudnn"] for p in POINTS) for m in MODES}
    return [
        "## Summary", "",
        f"Geometric means of our TFLOP/s over cuDNN's (`jax.nn.dot_product_attention("
        f"implementation=\"cudnn\")`, same process) and over FlashAttention-4's Hopper kernels "
        f"(FA4), per head dim over S = 1k, 4k, 16k, dense and causal. Grid: "
        f"{grid_env(data)} (`{GRID}`); FA4: {ANCHOR_ENV['device']}, {ANCHOR_ENV['date']}, "
        f"{ANCHOR_ENV['versions']} (`{FA4_FWD}`, `{FA4_FWDBWD}`).", "",
        *summary_table(rows), "",
        f"Lowest point against cuDNN: forward {lo['fwd']:.2f}×, forward+backward "
        f"{lo['fwdbwd']:.2f}×. FA4 ran in another process on another day; the per-point tables "
        f"below also give each ratio normalized by the cuDNN figure of its own run.", ""]


def section_grid(data, rows) -> list[str]:
    body = []
    for (d, s, c) in POINTS:
        f, b = rows[("fwd", d, s, c)], rows[("fwdbwd", d, s, c)]
        body.append([d, kfmt(s), "yes" if c else "no", f"{f['ours']:.0f}", f"{f['cudnn']:.0f}",
                     f"{f['vs_cudnn']:.2f}", f"{b['ours']:.0f}", f"{b['cudnn']:.0f}",
                     f"{b['vs_cudnn']:.2f}"])
    cfg = data["config"]
    gm = {m: geomean([rows[(m, *p)]["vs_cudnn"] for p in POINTS]) for m in MODES}
    return [
        "## The grid: CuTe kernels beside cuDNN", "",
        f"{grid_env(data)}; bf16 8192³ matmul {data['env']['matmul_bf16_tflops']} TFLOP/s in the "
        f"same run. Files: `{GRID}`, `{GRID_MD}` (with the output checks: 0 wrong).", "",
        f"bf16, B·S = {cfg['tokens']} tokens, N·D = {cfg['hidden']}, q / k / v `[B, S, N, D]`; "
        f"TFLOP/s = 4·B·N·S²·D for the forward (halved when causal), ×3.5 for "
        f"forward+backward; median of {cfg['reps']} reps. Ratio = ours / cuDNN.", "",
        *table(["D", "S", "causal", "ours fwd", "cuDNN fwd", "ratio", "ours fwd+bwd",
                "cuDNN fwd+bwd", "ratio"], body), "",
        f"Geometric mean: forward {gm['fwd']:.3f}×, forward+backward {gm['fwdbwd']:.3f}×.", "",
        "![TFLOP/s per grid point: ours, cuDNN, FA4](img/grid.png)", ""]


def section_fa4(rows) -> list[str]:
    body = []
    for (d, s, c) in POINTS:
        f, b = rows[("fwd", d, s, c)], rows[("fwdbwd", d, s, c)]
        body.append([d, kfmt(s), "yes" if c else "no", f"{f['ours']:.0f}", f"{f['fa4']:.0f}",
                     f"{f['vs_fa4']:.2f}", f"{f['vs_fa4_norm']:.2f}", f"{b['ours']:.0f}",
                     f"{b['fa4']:.0f}", f"{b['vs_fa4']:.2f}", f"{b['vs_fa4_norm']:.2f}"])
    gm = {m: (geomean([rows[(m, *p)]["vs_fa4"] for p in POINTS]),
              geomean([rows[(m, *p)]["vs_fa4_norm"] for p in POINTS])) for m in MODES}
    return [
        "## Against FlashAttention-4's Hopper kernels", "",
        f"FA4: {ANCHOR_ENV['versions']}, compiled for sm_90a and run through XLA FFI as a "
        f"`jax.export` artifact on the {ANCHOR_ENV['device']} ({ANCHOR_ENV['date']}; files "
        f"`{FA4_FWD}`, `{FA4_FWDBWD}`, copied from the peers' anchors). Ours: the grid above. "
        f"\"norm.\" divides each side by the cuDNN figure measured in its own run.", "",
        *table(["D", "S", "causal", "ours fwd", "FA4 fwd", "ratio", "norm.", "ours fwd+bwd",
                "FA4 fwd+bwd", "ratio", "norm."], body), "",
        f"Geometric mean: forward {gm['fwd'][0]:.3f}× (normalized {gm['fwd'][1]:.3f}×), "
        f"forward+backward {gm['fwdbwd'][0]:.3f}× (normalized {gm['fwdbwd'][1]:.3f}×).", ""]


def section_latency(data) -> list[str]:
    lat = {r["impl"]: r for r in data["rows"] if r["mode"] == "latency" and r["status"] == "ok"}
    body = [[name, f"{lat[name]['ms'] * 1e3:.1f}", f"{lat[name]['ms_min'] * 1e3:.1f}"]
            for name in ("cute", "cudnn") if name in lat]
    return [
        "## A small call", "",
        f"B = 1, N = 1, T = S = 128, D = 64, forward: each call timed alone, dispatch and "
        f"synchronization included, median of 200 ({grid_env(data)}; `{GRID}`).", "",
        *table(["implementation", "median µs", "min µs"], body), ""]


def section_backward() -> list[str]:
    data = load(BWD_BENCH)
    body = []
    for r in data["rows"]:
        kernel = r["backward"].split("(")[-1].rstrip(")")
        body.append([r["D"], kfmt(r["S"]), "yes" if r["causal"] else "no",
                     f"{r['ours_tflops']:.0f}", f"{r['cudnn_tflops']:.0f}", f"{r['ratio']:.2f}",
                     f"{r['bwd_tflops']:.0f}", f"`{kernel}`"])
    return [
        "## The backward at D = 256", "",
        f"Kernel bench of the dispatch picks at head dim 256, forward+backward beside cuDNN in one "
        f"process ({bench_env(data)}; `{BWD_BENCH}`). Backward alone = forward+backward time "
        f"minus forward time, counted as 2.5× the forward's FLOPs. B·S = 16k, N = 8.", "",
        *table(["D", "S", "causal", "ours fwd+bwd", "cuDNN fwd+bwd", "ratio", "ours backward "
                "alone", "backward variant"], body), ""]


def section_deterministic() -> list[str]:
    data = load(DETERMINISTIC)
    body = []
    for r in data["rows"]:
        if "deterministic_tflops" not in r:
            continue
        body.append([r["D"], kfmt(r["S"]), "yes" if r["causal"] else "no",
                     f"{r['dq_tma_tflops']:.0f}", f"{r['deterministic_tflops']:.0f}",
                     f"{r['deterministic_tflops'] / r['dq_tma_tflops']:.2f}"])
    return [
        "## Deterministic mode", "",
        f"`deterministic=True` orders the dQ additions by key block (bitwise identical results "
        f"over runs). Forward+backward TFLOP/s of the same kernel schedule with it off and on "
        f"({bench_env(data)}; `{DETERMINISTIC}`):", "",
        *table(["D", "S", "causal", "off", "on", "on / off"], body), "",
        "Causal calls pay most: the query blocks near the diagonal wait longest for their turn.",
        ""]


def section_segments() -> list[str]:
    data = load(SEGMENTS)
    rows = {r["name"]: r for r in data["rows"]}
    what = {"dense": "no mask", "alibi": "ALiBi", "docs": "8 packed documents (segment ids)",
            "random": "segment ids drawn at random per token (no block skipped)", "causal": "causal",
            "causal docs": "causal, 8 packed documents",
            "causal alibi docs": "causal, ALiBi, 8 packed documents"}
    body = [[what[n], f"{rows[n]['ms']:.3f}", f"{rows[n]['ms'] / rows['dense']['ms']:.2f}"]
            for n in what if n in rows]
    r0 = rows["dense"]
    return [
        "## Packed documents and ALiBi (forward)", "",
        f"B = {r0['B']}, S = {r0['S']}, N = {r0['N']}, D = {r0['D']}, bf16, one call of the "
        f"CuTe forward ({data['gpu']}, {data['date']}; `{SEGMENTS}`). Key blocks that no query "
        f"of a tile's documents can see are skipped, so 8 equal documents cost about 1/8 of the "
        f"dense call.", "",
        *table(["call", "ms", "vs no mask"], body), ""]


def section_long() -> list[str]:
    data = load(LONG)
    r = data["long_context_131072"]
    return [
        "## One long sequence", "",
        f"{r['problem']} on one H200 (jax 0.11.2, 2026-11-30; `{LONG}`, figures transcribed "
        f"from the run's output): {r['fwdbwd_ms']:.0f} ms, {r['tflops']:.0f} TFLOP/s; peak "
        f"device memory {r['peak_bytes_in_use'] / 1e9:.2f} GB for "
        f"{r['inputs_outputs_bytes'] / 1e9:.2f} GB of inputs, outputs and gradients (the rest "
        f"is the O(T) float32 dQ accumulator and row statistics); sampled output rows match "
        f"float64 to a relative error of {r['rel_l2_out_rows_vs_float64']:.1e}.", ""]


def section_pallas() -> list[str]:
    data = load(PALLAS)
    h = data["headline"]
    names = {"D128_S16k_noncausal": "D=128, S=16k", "D128_S16k_causal": "D=128, S=16k, causal",
             "D256_S16k_noncausal": "D=256, S=16k", "D64_S16k_noncausal": "D=64, S=16k"}

    def cell(x, mode, k):
        v = x.get(mode, {}).get(k)
        return f"{v:.0f}" if isinstance(v, (int, float)) else "–"

    body = [[names[k], cell(x, "fwd", "jaxflash_pallas"), cell(x, "fwd", "jax_pallas_triton_mha"),
             cell(x, "fwd", "cudnn"), cell(x, "fwd+bwd", "jaxflash_pallas"),
             cell(x, "fwd+bwd", "jax_pallas_triton_mha"), cell(x, "fwd+bwd", "cudnn")]
            for k, x in h.items()]
    grid = load(GRID_ALL)
    g = grid_index(grid, impls=("pallas", "cudnn"))
    gbody, ratios = [], {m: [] for m in MODES}
    for (d, s, c) in POINTS:
        cells = [d, kfmt(s), "yes" if c else "no"]
        for m in MODES:
            p, cu = g[("pallas", m, d, s, c)], g[("cudnn", m, d, s, c)]
            ratios[m].append(p / cu)
            cells += [f"{p:.0f}", f"{cu:.0f}", f"{p / cu:.2f}"]
        gbody.append(cells)
    return [
        "## The Pallas fallback", "",
        f"`implementation=\"pallas\"` lowered through Triton, beside cuDNN and JAX's "
        f"Pallas-Triton attention op in the same process ({data['gpu']}, {data['date']}, jax "
        f"{data['jax']}; `{PALLAS}`), TFLOP/s, bf16, B·S = 16k, N·D = 2048:", "",
        *table(["point", "ours fwd", "Pallas-Triton op fwd", "cuDNN fwd", "ours fwd+bwd",
                "Pallas-Triton op fwd+bwd", "cuDNN fwd+bwd"], body), "",
        "JAX's Pallas-Triton op refuses D = 256 (shared memory); ours runs it.", "",
        f"Over the whole grid ({grid_env(grid)}; `{GRID_ALL}`):", "",
        *table(["D", "S", "causal", "Pallas fwd", "cuDNN fwd", "ratio", "Pallas fwd+bwd",
                "cuDNN fwd+bwd", "ratio"], gbody), "",
        f"Geometric mean: forward {geomean(ratios['fwd']):.3f}× cuDNN, forward+backward "
        f"{geomean(ratios['fwdbwd']):.3f}×.", ""]


def ring_rows():
    out = []
    for name in RING:
        data = load(name)
        impl = data["config"]["impl"]
        by = {(r["name"], r["mode"]): r for r in data["rows"]}
        for mode in MODES:
            one = by[("single", mode)]
            zz = by.get(("ring-zigzag", mode))
            ct = by.get(("ring-contiguous", mode))
            out.append(dict(impl=impl, mode=mode, one=one, zz=zz, ct=ct, env=data["env"],
                            cfg=data["config"], file=name))
    return out


def section_ring() -> list[str]:
    rows = ring_rows()
    body = []
    for r in rows:
        one, zz, ct = r["one"], r["zz"], r["ct"]
        body.append([r["impl"], MODE_NAME[r["mode"]], f"{one['ms']:.1f} ({one['tflops']:.0f})",
                     f"{zz['ms']:.1f} ({zz['tflops']:.0f})", f"{one['ms'] / zz['ms']:.2f}×",
                     f"{ct['ms']:.1f} ({one['ms'] / ct['ms']:.2f}×)" if ct else "–"])
    e, cfg = rows[0]["env"], rows[0]["cfg"]
    return [
        "## Ring attention on two GPUs", "",
        f"One causal sequence, S = {cfg['s'] // 1024}k, N = {cfg['heads']}, D = {cfg['d']}, "
        f"bf16, `jaxflash.ring_attention` over {e['device_count']} × {e['device']} ("
        f"{e['date_utc'][:10]}, jax {e['jax']}, cuDNN {e['cudnn']}; "
        + ", ".join(f"`{n}`" for n in RING) + "). ms (TFLOP/s):", "",
        *table(["backend", "mode", "1 GPU", "2 GPUs, zigzag", "speed-up",
                "2 GPUs, contiguous (speed-up)"], body), "",
        "The zigzag layout balances the causal work between the devices; contiguous chunks "
        "leave one device with most of it.", "",
        "![ring attention speed-up](img/ring.png)", ""]


def lm_numbers():
    data = load(LM)
    curves = {k: [(int(s), v) for s, v in sorted(data["runs"][k]["losses"].items(),
                                                  key=lambda kv: int(kv[0]))]
              for k in ("xla", "cute")}
    return data, curves


def section_lm() -> list[str]:
    data, _ = lm_numbers()
    x, c = data["xla"], data["candidates"]["cute"]
    cfg = data["runs"]["cute"]["config"]
    a = data["argv"]
    steps = a[a.index("--steps") + 1]
    body = [["`xla` (float32 reference)", f"{x['final_loss']:.4f}", "–", f"{x['val_loss']:.4f}",
             f"{x['tokens_per_s']:,.0f}"],
            ["`cute`", f"{c['final_loss']:.4f}", f"{c['final_loss_rel_diff'] * 100:.2f}%",
             f"{c['val_loss']:.4f}", f"{c['tokens_per_s']:,.0f} ({c['speedup_vs_xla']:.2f}×)"]]
    return [
        "## Training check", "",
        f"The example language model (`examples/lm`: {cfg['n_layers']} layers, d = "
        f"{cfg['d_model']}, {cfg['n_heads']} heads / {cfg['n_kv_heads']} KV heads, D = "
        f"{cfg['d_model'] // cfg['n_heads']}, {cfg['dtype']}, {cfg['seq_len']}-token context) "
        f"trained {steps} steps from the same initialization on the same batches with "
        f"`implementation=\"cute\"` and with the float32 reference ({data['device']}, "
        f"{data['date_utc'][:10]}, jax {data['jax']}; `{LM}`). Pass criterion: final losses "
        f"within {data['rtol'] * 100:.0f}%.", "",
        *table(["run", f"loss at step {data['final_step']}", "difference", "validation loss",
                "tokens/s"], body), "",
        "![training loss, cute against the reference](img/lm-loss.png)", ""]


def section_fp8() -> list[str]:
    data = load(FP8_BENCH)
    env = data["env"]
    body = [[str(r["D"]), kfmt(r["S"]), "yes" if r["causal"] else "no", f"{r['ours_fp8']:.0f}",
             f"{r['ours_bf16']:.0f}", f"{r['cudnn_fp8']:.0f}", f"{r['ours_fp8_e2e']:.0f}",
             f"{r['ours_fp8'] / r['cudnn_fp8']:.2f}", f"{r['ours_fp8'] / r['ours_bf16']:.2f}"]
            for r in data["rows"]]
    sm = data["summary"]
    fb = {"rows": [r for name in FP8_FWDBWD for r in load(name)["rows"]]}
    fbrows = [[str(r["D"]), kfmt(r["S"]), "yes" if r["causal"] else "no", f"{r['ours_fp8']:.0f}",
               f"{r['ours_bf16']:.0f}", f"{r['cudnn_fp8']:.0f}" if r.get("cudnn_fp8") else "",
               f"{r['ours_fp8_e2e']:.0f}", f"{r['ours_fp8'] / r['ours_bf16']:.2f}",
               f"{r['ours_fp8'] / r['cudnn_fp8']:.2f}" if r.get("cudnn_fp8") else ""]
              for r in fb["rows"]]
    return [
        "## FP8 forward (Hopper)", "",
        f"TFLOP/s, B·S = 16384, N·D = 2048, FP8 inputs with per-tensor scales, bf16 output; "
        f"{env['device']}, {env['date_utc'][:10]}, jax {env['jax']}, cuDNN {env.get('cudnn')} "
        f"(`{FP8_BENCH}`). The kernel reads V^T written by the XLA side (the in-kernel "
        f"transpose it replaces cost 40-60% of the time, `{FP8_DIAG}`); that transpose is inside "
        f"the timed call. \"e2e\" is `precision=\"fp8\"` from bf16 inputs, the library's "
        f"prologue (Hadamard transform and 128-row block quantization) included.", "",
        *table(["D", "S", "causal", "ours FP8", "ours bf16", "cuDNN FP8", "ours e2e",
                "FP8 / cuDNN FP8", "FP8 / bf16"], body), "",
        f"Geomean against cuDNN's FP8 forward {sm['geomean_fp8_vs_cudnn_fp8']:.2f}× (target "
        f"{sm['target_vs_cudnn']}×); against our bf16 forward at S ≥ 4k, D = 128 / 256 "
        f"{sm['geomean_fp8_vs_bf16_S>=4k_D128/256']:.2f}× (target {sm['target_vs_bf16']}×); "
        f"D = 256, S = 16k dense {sm['d256_s16k_dense_tflops']:.0f} TFLOP/s (target "
        f"{sm['target_d256_tflops']}); e2e from bf16 at least "
        f"{sm['min_fp8_e2e_vs_bf16_S>=4k']:.2f}× our bf16 (target {sm['target_e2e_vs_bf16']}×).",
        "",
        *section_fp8_e2e(),
        f"Forward + backward (TFLOP/s at 3.5× the forward's FLOPs; "
        f"{', '.join(f'`{n}`' for n in FP8_FWDBWD)}, one device call each, run after the "
        f"forward's; "
        f"cuDNN's FP8 backward runs at D = 128 only):", "",
        *table(["D", "S", "causal", "ours FP8", "ours bf16", "cuDNN FP8", "ours e2e",
                "FP8 / bf16", "FP8 / cuDNN FP8"], fbrows), ""]


def section_fp8_e2e() -> list[str]:
    data = load(FP8_E2E)
    env = data["env"]
    body = [[str(r["D"]), kfmt(r["S"]), f"{r['bf16']:.0f}", f"{r['fp8_kernel']:.0f}",
             f"{r['e2e_xla']:.0f}", f"{r['e2e_triton']:.0f}", f"{r['e2e_triton_gemm']:.0f}",
             f"{r['e2e_triton_gemm'] / r['bf16']:.2f}",
             f"{r['fp8_kernel'] / r['bf16']:.2f}"] for r in data["e2e"]]
    sm = data["summary"]
    return [
        f"`precision=\"fp8\"` from bf16 inputs with each prologue (Hadamard, amax and "
        f"quantization, 128-row block scales): the XLA arrangement, the Triton kernel with "
        f"butterflies, and the library's default, the Triton kernel with the Hadamard of Q and "
        f"K as a tensor-core product; \"FP8 kernel\" is the same block-scale kernel on inputs "
        f"quantized beforehand. Dense, TFLOP/s; {env['device']}, {env['date_utc'][:10]} "
        f"(`{FP8_E2E}`; the prologue's tilings swept at 4k in the same run, the fastest exact "
        f"ones taken for the end-to-end part and by the library, which the forward table above "
        f"ran with):", "",
        *table(["D", "S", "ours bf16", "FP8 kernel", "e2e, XLA prologue",
                "e2e, butterflies", "e2e, tensor-core Hadamard", "e2e / bf16",
                "FP8 kernel / bf16"], body), "",
        f"Geomean e2e / bf16 at S ≥ 4k {sm['geomean_e2e_triton_gemm_vs_bf16_S>=4k']:.2f}× "
        f"(target {sm['target_e2e_vs_bf16']}×). The prologue reads 2 and writes 1 byte per "
        f"element of Q, K and V; e2e can exceed bf16 by at most what the FP8 kernel alone "
        f"does (last column), which at D = 64 and D = 128 is below the target "
        f"before any prologue.", ""]


def section_mods() -> list[str]:
    data = load(MODS)
    env = data["env"]
    fb = load(MODS_FWDBWD)
    rows = [r for r in data["rows"] + fb["rows"] if r.get("status") == "ok" and r.get("ms")]
    seen, uniq = set(), []
    for r in rows:  # the second run's forward+backward rows fill the first's missing ones
        if (r["case"], r["mode"], r["impl"]) not in seen:
            seen.add((r["case"], r["mode"], r["impl"]))
            uniq.append(r)
    base = {(r["case"], r["mode"]): r["ms"] for r in uniq if r["impl"] == "pallas-mods"}
    body = []
    for r in uniq:
        tiles = r.get("tflops_tiles")
        vs = base.get((r["case"], r["mode"]))
        body.append([r["case"], r["mode"], r["impl"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
                     f"{tiles:.0f}" if tiles else "", f"{vs / r['ms']:.2f}×" if vs else ""])
    kb = load(MODS_KERNEL)
    krows = []
    for r in kb["rows"]:
        f = lambda *ks: next((f"{r[k]:.2f}" for k in ks if r.get(k) is not None), "")
        krows.append([r["case"], f("mod_over_builtin_fwd"), f("mod_over_builtin_fwdbwd"),
                      f("modbm_over_builtin_fwd"), f("sparse_over_dense_fwd"),
                      f("modbm_sparse_over_dense_fwd", "modbm_sparse_over_dense_fwd (derived)")])
    sched = load(MODS_SCHED)
    names = ["default", "ps_tp", "ps_tp_we", "ps_tp_pairs"]
    srows = [[r["case"], f"{r['visible_tile_fraction']:.3f}"]
             + [f"{r[n]['sparse_over_dense_fwd']:.2f}" if n in r else "" for n in names]
             for r in sched["rows"]]
    return [
        "## Custom attention (mods)", "",
        f"bf16, D = 128, 16 heads, 16k tokens per call (B·S); {env['device']}, "
        f"{env['date_utc'][:10]}, jax {env['jax']}, cuDNN {env.get('cudnn')} (`{MODS}`; the "
        f"window, T5 and ALiBi forward+backward rows from `{MODS_FWDBWD}`, a second run the "
        f"same day). TFLOP/s count the dense causal work; \"over tiles\" counts only the block "
        f"mask's visited tiles. cudnn-dense is `jax.nn.dot_product_attention` given the "
        f"equivalent dense bias or mask. \"+aux\" rows also take gradients of the aux arrays.",
        "",
        *table(["case", "mode", "impl", "ms", "TFLOP/s", "over tiles", "vs pallas-mods"], body),
        "",
        f"Mods against the built-ins they reproduce (time ratio, 1.00 = as fast) and the sparse "
        f"mods' TFLOP/s over visible tiles against the dense kernel's (`{MODS_KERNEL}`). \"mod\" "
        f"passes no `BlockMask` (a mask without aux gets its table once per shape, a mask with "
        f"aux evaluates it per call); \"bm\" passes one built once.", "",
        *table(["case", "mod / built-in fwd", "mod / built-in fwd+bwd", "bm / built-in fwd",
                "sparse / dense fwd", "bm sparse / dense fwd"], krows), "",
        f"The sparse calls' forward under each schedule, TFLOP/s over the visited tiles / the "
        f"dense kernel's (`{MODS_SCHED}`): the 1024 window over 16k keys visits as few tiles "
        f"per row as a 1k sequence does, and the short-sequence loop (persistent, tile pipe, "
        f"per-warpgroup epilogue: `ps_tp_we`) is now its built-in's pick at hd 128.", "",
        *table(["call", "visible tiles", *names], srows), ""]


def section_sources() -> list[str]:
    out = ["## Sources", "",
           "Regenerate this page with `python -m benchmarks.performance_doc`; "
           "`python -m benchmarks.performance_doc --check` fails when it is out of date. "
           "Every file is in `benchmarks/results/` (indexed in its README):", ""]
    for name in sorted(SOURCES):
        out.append(f"- `{name}`")
    return out + [""]


def markdown() -> str:
    data, rows = grid_numbers()
    lines = [
        "# Performance", "",
        "<!-- Generated by `python -m benchmarks.performance_doc` from the files listed under "
        "Sources. Do not edit by hand. -->", "",
        "Every figure below was measured on one NVIDIA H200 (132 SMs, driver 580) lent for the "
        "purpose, and is read from a result file in `benchmarks/results/` that records the GPU, "
        "date and versions. Nothing is claimed for Blackwell: the kernels are Hopper (sm_90a) "
        "kernels. How the benchmark measures (inputs, checks before timing, timing, FLOP "
        "counts) is in [benchmarks/README.md](../benchmarks/README.md); how the kernels are "
        "built, and what was tried and lost, in [design.md](design.md).", ""]
    for sec in (section_summary(data, rows), section_grid(data, rows), section_fa4(rows),
                section_latency(data), section_backward(), section_deterministic(),
                section_segments(), section_long(), section_pallas(), section_ring(),
                section_lm(), section_fp8(), section_mods(), section_sources()):
        lines += sec
    return "\n".join(lines).rstrip("\n") + "\n"


# -- plots --------------------------------------------------------------------------------------
def _save(fig, name):
    os.makedirs(IMG, exist_ok=True)
    fig.savefig(os.path.join(IMG, name), dpi=100, metadata={"Software": None})


def plots():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.hashsalt": "jaxflash", "font.size": 9})

    data, rows = grid_numbers()
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.5))
    x = list(range(len(POINTS)))
    labels = [f"D{d}\n{kfmt(s)}\n{'causal' if c else ''}" for (d, s, c) in POINTS]
    for ax, mode in zip(axes, MODES):
        for key, label, style in (("ours", "jaxflash (cute)", dict(color="tab:red", lw=2.5,
                                                                    marker="o")),
                                  ("cudnn", "cuDNN (same run)", dict(color="black", lw=1.8,
                                                                     marker="D", ls="--")),
                                  ("fa4", "FlashAttention-4 sm90", dict(color="tab:blue", lw=1.4,
                                                                        marker="^", ls=":"))):
            ax.plot(x, [rows[(mode, *p)][key] for p in POINTS], label=label, **style)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        e = data["env"]
        ax.set_title(f"{MODE_NAME[mode]}, bf16: {e['device']}, {e['date_utc'][:10]}, jax "
                     f"{e['jax']}, cuDNN {e['cudnn']} (FA4: {ANCHOR_ENV['date']})")
    fig.tight_layout()
    _save(fig, "grid.png")
    plt.close(fig)

    rr = ring_rows()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [f"{r['impl']}\n{MODE_NAME[r['mode']]}" for r in rr]
    xs = list(range(len(rr)))
    w = 0.38
    ax.bar([i - w / 2 for i in xs], [r["one"]["tflops"] for r in rr], w, label="1 GPU",
           color="tab:gray")
    ax.bar([i + w / 2 for i in xs], [r["zz"]["tflops"] for r in rr], w,
           label="2 GPUs, zigzag ring", color="tab:red")
    ax.set_xticks(xs)
    ax.set_xticklabels(names)
    ax.set_ylabel("TFLOP/s (whole problem)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    e = rr[0]["env"]
    ax.set_title(f"causal S=64k, N=16, D=128: {e['device_count']} x {e['device']}, "
                 f"{e['date_utc'][:10]}, jax {e['jax']}")
    fig.tight_layout()
    _save(fig, "ring.png")
    plt.close(fig)

    lm, curves = lm_numbers()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k, style in (("xla", dict(color="black", lw=1.2, label="xla (float32 reference)")),
                     ("cute", dict(color="tab:red", lw=1.0, label="cute", alpha=0.8))):
        ax.plot([s for s, _ in curves[k]], [v for _, v in curves[k]], **style)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"example LM: {lm['device']}, {lm['date_utc'][:10]}, jax {lm['jax']}")
    fig.tight_layout()
    _save(fig, "lm-loss.png")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.performance_doc",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if docs/performance.md differs from what would be generated")
    a = p.parse_args(argv)
    text = markdown()
    if a.check:
        try:
            with open(DOC, encoding="utf-8") as f:
                have = f.read()
        except FileNotFoundError:
            have = ""
        if have != text:
            sys.stdout.writelines(difflib.unified_diff(
                have.splitlines(True), text.splitlines(True), "docs/performance.md",
                "generated", n=1))
            print("docs/performance.md is out of date: run python -m benchmarks.performance_doc",
                  file=sys.stderr)
            return 1
        print("docs/performance.md is up to date")
        return 0
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text)
    plots()
    print(f"wrote {os.path.relpath(DOC, ROOT)} and docs/img/{{grid,ring,lm-loss}}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
