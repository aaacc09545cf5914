"""The first-run kit for the sm_100a kernels: one command on the first Blackwell machine.

    python -m devtools.blackwell_first_run --out DIR            # on a B200 / GB200
    python -m devtools.blackwell_first_run build --out KDIR     # here (DSL): the kernels it needs
                                                                # (forwards, backwards: every pass)

On a compute capability 10.0 GPU, with the gate opened for the run (JAXFLASH_CUTE_UNVERIFIED=1),
it runs, writing each step's results into DIR:

1. ``checks.json``: the float64 check cases below through ``flash_attention(implementation=
   "cute")`` (dispatch picks the sm100 kernels; each case asserts which one ran), output and LSE
   against the float64 oracle of `devtools.devrun`, cuDNN's error on the same inputs beside ours;
2. ``gpu-tests.xml``: every ``tests/kernels/test_sm100*_gpu.py`` (the forward's, the FP8
   forward's, the 2-CTA forward's, the backward's when present) through pytest;
3. ``memcheck.log`` / ``racecheck.log``: compute-sanitizer on a few check cases;
4. ``grid.json``: the anchor grid (B*S = 16384, N*D = 2048; D 64 / 128 / 256, S 1k / 4k / 16k,
   dense and causal) ours beside cuDNN, FlashAttention-4 too when ``flash_attn.cute`` imports,
   and the FP8 forward at D 128 beside our bf16;
5. ``verdict.json`` (`devtools.blackwell_verdict`): which features passed and the exact change
   to `jaxflash/kernels/policy/verified.py` that clears them.

Anywhere else (CPU, the H200) it refuses before running anything: ``verdict.json`` says
``"status": "not_blackwell"`` with the device found, and the exit status is 2. Without the DSL
the kernels come from ``JAXFLASH_KERNEL_DIR`` (build them here with the ``build`` command).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

from devtools import blackwell_verdict as V

NOT_BLACKWELL = 2
_SM100_FWD = ":FlashFwdSm100"
_SM100_FP8 = ":FlashFwdSm100Fp8"

# (name, config class, features, (B, T, S, N, K, H, dtype), extras). Extras as devtools.devrun's
# check cases (window, softcap, q_seqlen / kv_seqlen, alibi, q_segs / kv_segs, k_ramp), plus
# "causal" and, for FP8, "fp8": the scale granularity ("tensor", "head", "block").
CASES = [
    ("bf16 h128 dense gqa4 odd", "Sm100FwdConfig", ("head_dim_128", "rescale"),
     (2, 1000, 1000, 8, 2, 128, "bfloat16"), {}),
    ("bf16 h128 causal T<S", "Sm100FwdConfig", ("causal", "head_dim_128", "rescale"),
     (2, 777, 1300, 4, 4, 128, "bfloat16"), {"causal": True}),
    ("bf16 h64 mqa", "Sm100FwdConfig", ("head_dim_64", "rescale"),
     (2, 257, 300, 6, 1, 64, "bfloat16"), {}),
    ("fp16 h64 causal T>S", "Sm100FwdConfig", ("causal", "fp16", "head_dim_64", "rescale"),
     (3, 129, 77, 2, 2, 64, "float16"), {"causal": True}),
    ("bf16 h256 causal mqa", "Sm100FwdConfig", ("causal", "head_dim_256", "rescale"),
     (2, 700, 700, 2, 1, 256, "bfloat16"), {"causal": True}),
    ("bf16 h256 dense", "Sm100FwdConfig", ("head_dim_256", "rescale"),
     (1, 640, 900, 4, 4, 256, "bfloat16"), {}),
    ("bf16 h128 causal softcap", "Sm100FwdConfig", ("causal", "softcap", "head_dim_128",
                                                    "rescale"),
     (2, 500, 500, 4, 2, 128, "bfloat16"), {"causal": True, "softcap": 20.0}),
    ("bf16 h128 window", "Sm100FwdConfig", ("window", "head_dim_128", "rescale"),
     (2, 800, 800, 4, 2, 128, "bfloat16"), {"window": (100, 37)}),
    ("bf16 h64 causal window", "Sm100FwdConfig", ("causal", "window", "head_dim_64", "rescale"),
     (2, 700, 700, 4, 4, 64, "bfloat16"), {"causal": True, "window": (129, 0)}),
    ("bf16 h128 seqlens", "Sm100FwdConfig", ("lengths", "head_dim_128", "rescale"),
     (3, 300, 400, 4, 2, 128, "bfloat16"),
     {"q_seqlen": [300, 131, 17], "kv_seqlen": [400, 0, 255]}),
    ("bf16 h128 alibi causal gqa", "Sm100FwdConfig", ("alibi", "causal", "head_dim_128",
                                                      "rescale"),
     (2, 555, 555, 8, 2, 128, "bfloat16"), {"causal": True, "alibi": 1}),
    ("bf16 h128 segments causal", "Sm100FwdConfig", ("segments", "causal", "head_dim_128",
                                                     "rescale"),
     (2, 1000, 1000, 8, 2, 128, "bfloat16"),
     {"causal": True, "q_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]],
      "kv_segs": [[(0, 1), (1, 300), (2, 129), (3, 570)], [(7, 1000)]]}),
    # head dims 96 (SW64 operand rows, 352 tensor-memory columns) and 192 (64-key tiles)
    ("fp16 h96 causal gqa", "Sm100FwdConfig", ("causal", "fp16", "head_dim_96", "rescale"),
     (2, 555, 600, 6, 2, 96, "float16"), {"causal": True}),
    ("bf16 h96 softcap lengths", "Sm100FwdConfig", ("softcap", "lengths", "head_dim_96",
                                                    "rescale"),
     (2, 400, 530, 4, 4, 96, "bfloat16"),
     {"softcap": 20.0, "q_seqlen": [400, 77], "kv_seqlen": [530, 129]}),
    ("bf16 h192 dense gqa odd", "Sm100FwdConfig", ("head_dim_192", "rescale"),
     (2, 777, 900, 8, 2, 192, "bfloat16"), {}),
    ("bf16 h192 causal window", "Sm100FwdConfig", ("causal", "window", "head_dim_192",
                                                   "rescale"),
     (2, 700, 700, 4, 4, 192, "bfloat16"), {"causal": True, "window": (150, 0)}),
    ("bf16 h192 alibi segments causal", "Sm100FwdConfig",
     ("alibi", "segments", "causal", "head_dim_192", "rescale"),
     (2, 600, 600, 4, 2, 192, "bfloat16"),
     {"causal": True, "alibi": 1, "q_segs": [[(0, 200), (1, 400)], [(3, 600)]],
      "kv_segs": [[(0, 200), (1, 400)], [(3, 600)]]}),
    # long key loop, keys decaying right to left: every block raises the row max (the
    # conditional rescale and the polynomial exp2 over many blocks)
    ("bf16 h128 long ramp", "Sm100FwdConfig", ("head_dim_128", "rescale"),
     (1, 256, 8192, 2, 1, 128, "bfloat16"), {"k_ramp": 3.0}),
    # FP8 (e4m3): against float64 on the dequantized operands
    ("fp8 h128 causal gqa", "Sm100Fp8FwdConfig", ("causal", "head_dim_128"),
     (1, 1031, 1031, 8, 2, 128, "float8_e4m3fn"), {"causal": True, "fp8": "head"}),
    ("fp8 h64 dense tensor", "Sm100Fp8FwdConfig", ("head_dim_64",),
     (2, 777, 777, 4, 4, 64, "float8_e4m3fn"), {"fp8": "tensor"}),
    ("fp8 h256 blocks", "Sm100Fp8FwdConfig", ("block_scales", "head_dim_256"),
     (1, 700, 1300, 2, 2, 256, "float8_e4m3fn"), {"fp8": "block"}),
    ("fp8 h128 window", "Sm100Fp8FwdConfig", ("window", "head_dim_128"),
     (1, 1500, 1500, 4, 2, 128, "float8_e4m3fn"), {"window": (200, 0), "fp8": "head"}),
    ("fp8 h128 softcap lengths blocks", "Sm100Fp8FwdConfig",
     ("softcap", "lengths", "block_scales", "head_dim_128"),
     (2, 900, 1100, 4, 4, 128, "float8_e4m3fn"),
     {"softcap": 20.0, "q_seqlen": [863, 450], "kv_seqlen": [1095, 366], "fp8": "block"}),
    ("fp8 h128 segments causal", "Sm100Fp8FwdConfig", ("segments", "causal", "head_dim_128"),
     (2, 700, 650, 4, 2, 128, "float8_e4m3fn"),
     {"causal": True, "fp8": "head",
      "q_segs": [[(0, 100), (1, 37), (2, 250), (3, 313)], [(5, 699), (6, 1)]],
      "kv_segs": [[(0, 100), (1, 37), (3, 513)], [(5, 650)]]}),
]
SANITIZER_CASES = ("bf16 h128 seqlens", "bf16 h64 causal window", "fp8 h256 blocks",
                   "bf16 h128 segments causal", "bf16 h192 causal window")
# output tolerance against float64 (rel L2); FP8: 1.25x the contract emulation's own error
TOL = {"bfloat16": 2e-2, "float16": 4e-3}


# ------------------------------------------------------------------------------ the device
def device_info() -> dict:
    """{"platform", "kind", "compute_capability"} of the first device JAX sees."""
    try:
        import jax
        d = jax.devices()[0]
    except Exception as e:  # no usable backend at all
        return {"platform": "none", "kind": None, "compute_capability": None,
                "error": f"{type(e).__name__}: {e}"}
    return {"platform": d.platform, "kind": getattr(d, "device_kind", None),
            "compute_capability": (str(d.compute_capability)
                                   if getattr(d, "compute_capability", None) else None)}


def is_blackwell(dev: dict) -> bool:
    return dev.get("platform") == "gpu" and dev.get("compute_capability") == "10.0"


# ------------------------------------------------------------------------------ check cases
def _call(name, ex, q, k, v, scales, qs, kvs, slopes, q_seg, kv_seg):
    """The API call of a case (kwargs) and the kernel class dispatch must pick."""
    import jax.numpy as jnp
    kw = {"is_causal": bool(ex.get("causal")), "implementation": "cute"}
    if ex.get("window"):
        kw["local_window_size"] = tuple(ex["window"])
    if ex.get("softcap"):
        kw["softcap"] = float(ex["softcap"])
    if qs is not None:
        kw["query_seq_lengths"] = qs
    if kvs is not None:
        kw["key_value_seq_lengths"] = kvs
    if slopes is not None:
        kw["alibi_slopes"] = jnp.asarray(slopes)
    if q_seg is not None:
        kw["q_segment_ids"], kw["kv_segment_ids"] = jnp.asarray(q_seg), jnp.asarray(kv_seg)
    if scales is not None:
        kw.update(q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
    return kw, (_SM100_FP8 if scales is not None else _SM100_FWD)


def run_case(case) -> dict:
    """One check case: ours through the API against float64 (and cuDNN's error beside)."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from devtools import devrun
    name, cls, feats, (B, T, S, N, K, H, dtype), ex = case
    fp8 = ex.get("fp8")
    row = {"name": name, "cls": cls, "features": list(feats), "shape": [B, T, S, N, K, H],
           "dtype": dtype}
    q, k, v, _, qs, kvs = devrun.fresh_inputs(B, T, S, N, K, H, "float32" if fp8 else dtype, ex)
    slopes, q_seg, kv_seg = devrun._alibi_and_segments(ex, B, T, S, N)
    scale = 1.0 / np.sqrt(H)
    scales = None
    if fp8:
        from jaxflash import quantize as Q
        e4 = jnp.float8_e4m3fn
        (q, qsc), (k, ksc), (v, vsc) = (Q.quantize(x, e4, granularity=fp8) for x in (q, k, v))
        scales = (qsc, ksc, vsc)
        f64 = [np.asarray(Q.dequantize(x, s, granularity=fp8), np.float64)
               for x, s in ((q, qsc), (k, ksc), (v, vsc))]
    else:
        f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)]
    kw, want = _call(name, ex, q, k, v, scales, qs, kvs, slopes, q_seg, kv_seg)
    plan = jaxflash.explain(q, k, v, **kw)
    row["plan"] = str(plan.detail.fwd.config.key) if plan.backend == "cute" else str(plan)
    if plan.backend != "cute" or not plan.detail.fwd.kernel.endswith(want):
        row.update(ok=False, error=f"dispatch did not pick {want[1:]}: {plan}")
        return row
    f = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, return_residual=True, **kw))
    o, lse = f(q, k, v)
    o = np.asarray(o.astype(jnp.float32))
    lse = np.asarray(lse)
    ref_o, ref_lse = devrun.np_reference(*f64, scale, bool(ex.get("causal")), ex.get("window"),
                                         ex.get("softcap"), ex.get("q_seqlen"),
                                         ex.get("kv_seqlen"), slopes, q_seg, kv_seg)
    fin = np.isfinite(ref_lse)
    row["nan_out"] = int(np.isnan(o).sum())
    row["rel_out"] = devrun._rel(o, ref_o)
    row["rel_lse"] = devrun._rel(lse[fin], ref_lse[fin]) if fin.any() else 0.0
    row["empty_lse_ok"] = bool(np.all(np.isneginf(lse[~fin])))
    row["max_abs_out_where_empty"] = float(
        np.abs(np.transpose(o, (0, 2, 1, 3))[~fin]).max()) if (~fin).any() else 0.0
    if fp8:  # the contract's own error on the same inputs (the emulation, XLA)
        kw_e = dict(kw, implementation="xla")
        o_e = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, **kw_e))(q, k, v)
        row["rel_out_contract"] = devrun._rel(np.asarray(o_e.astype(jnp.float32)), ref_o)
        tol = 1.25 * row["rel_out_contract"] + 2e-3
        lse_tol = 5e-2
    else:
        tol, lse_tol = TOL[dtype], 1e-3
        if not (ex.get("softcap") or ex.get("alibi") or "q_segs" in ex):
            row.update(devrun._cudnn_error(q, k, v, scale, bool(ex.get("causal")), ex, ref_o, o))
    row["ok"] = bool(row["nan_out"] == 0 and row["rel_out"] < tol and row["rel_lse"] < lse_tol
                     and row["empty_lse_ok"] and row["max_abs_out_where_empty"] == 0.0)
    return row


def check(out_path: str, names=None) -> list[dict]:
    from devtools import devrun
    rows: list[dict] = []
    for case in CASES:
        if names and case[0] not in names:
            continue
        dog = devrun.start_watchdog(case[0], 120.0)
        try:
            row = run_case(case)
        except Exception as e:
            row = {"name": case[0], "cls": case[1], "features": list(case[2]), "ok": False,
                   "error": f"{type(e).__name__}: {str(e)[:400]}"}
        devrun.finish_case(dog, row, rows, out_path)
    return rows


# ------------------------------------------------------------------------------ the steps
def gpu_tests(out_dir: str, timeout: int) -> dict[str, str]:
    """pytest on tests/kernels/test_sm100*_gpu.py; {nodeid: outcome} from its JUnit XML."""
    files = sorted(glob.glob("tests/kernels/test_sm100*_gpu.py"))
    xml = os.path.join(out_dir, "gpu-tests.xml")
    log = os.path.join(out_dir, "gpu-tests.log")
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-p",
                        "no:cacheprovider", f"--junitxml={xml}", *files], stdout=fh,
                       stderr=subprocess.STDOUT, timeout=timeout, check=False)
    return junit_outcomes(xml)


def junit_outcomes(xml_path: str) -> dict[str, str]:
    import xml.etree.ElementTree as ET
    if not os.path.exists(xml_path):
        return {}
    out = {}
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        nodeid = f"{tc.get('classname')}::{tc.get('name')}"
        tags = {c.tag for c in tc}
        out[nodeid] = ("failed" if "failure" in tags else "error" if "error" in tags
                       else "skipped" if "skipped" in tags else "passed")
    return out


def sanitizers(out_dir: str, timeout: int) -> dict[str, dict]:
    """compute-sanitizer memcheck and racecheck over `SANITIZER_CASES` (a fresh process
    each); clean = exit 0 and an error summary of 0 errors."""
    import re
    import shutil
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"memcheck": {"clean": False, "error": "compute-sanitizer not found"},
                "racecheck": {"clean": False, "error": "compute-sanitizer not found"}}
    res = {}
    for kind in ("memcheck", "racecheck"):
        log = os.path.join(out_dir, f"{kind}.log")
        cmd = [tool, "--tool", kind, "--print-limit", "20", sys.executable, "-m",
               "devtools.blackwell_first_run", "check", "--cases", ";".join(SANITIZER_CASES),
               "--out", os.path.join(out_dir, f"san-{kind}")]
        try:
            with open(log, "w") as fh:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                    check=False).returncode
        except subprocess.TimeoutExpired:
            res[kind] = {"clean": False, "error": f"timed out after {timeout} s"}
            continue
        text = open(log).read()
        m = re.search(r"ERROR SUMMARY: (\d+) error", text)
        res[kind] = {"clean": rc == 0 and m is not None and m.group(1) == "0", "rc": rc,
                     "errors": int(m.group(1)) if m else None, "log": log}
    return res


def grid(out_path: str, budget_s: float) -> dict:
    """The anchor grid: ours (dispatch, cute) beside cuDNN (and FlashAttention-4), TFLOP/s."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from devtools import devrun
    fa4 = _fa4_runner()
    rows, t_end = [], time.time() + budget_s
    for D in (64, 128, 256):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                if time.time() > t_end:
                    break
                B, N = 16384 // S, 2048 // D
                q, k, v, _, _, _ = devrun.fresh_inputs(B, S, S, N, N, D, "bfloat16", {})
                flops = 4.0 * B * N * S * S * D / (2 if causal else 1)
                fns = {"ours": jax.jit(lambda q, k, v: jaxflash.flash_attention(
                           q, k, v, is_causal=causal, implementation="cute")),
                       "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                           q, k, v, is_causal=causal, implementation="cudnn"))}
                row = {"D": D, "S": S, "causal": causal}
                try:
                    times = devrun._time_all(fns, (q, k, v))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    times = {}
                for name, t in times.items():
                    row[f"{name}_tflops"] = flops / t / 1e12 if t else None
                if fa4 is not None:
                    row["fa4_tflops"] = fa4(B, S, N, D, causal, flops)
                devrun.record_row(row, rows, out_path)
    # FP8 D128 beside our bf16 (per-head scales)
    from jaxflash import quantize as Q
    for S in (4096, 16384):
        if time.time() > t_end:
            break
        B, N, D = 16384 // S, 16, 128
        q, k, v, _, _, _ = devrun.fresh_inputs(B, S, S, N, N, D, "bfloat16", {})
        q8, k8, v8 = (Q.quantize(x, jnp.float8_e4m3fn, granularity="head") for x in (q, k, v))
        flops = 4.0 * B * N * S * S * D
        fns = {"ours_fp8": jax.jit(lambda a, b, c, d, e, g: jaxflash.flash_attention(
                   a, b, c, q_scale=d, k_scale=e, v_scale=g, implementation="cute")),
               }
        row = {"D": D, "S": S, "causal": False, "fp8": True}
        try:
            t = devrun._time_all(fns, (q8[0], k8[0], v8[0], q8[1], k8[1], v8[1]))
            row["ours_fp8_tflops"] = flops / t["ours_fp8"] / 1e12
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        devrun.record_row(row, rows, out_path)
    return {"rows": len(rows), "file": out_path, "fa4": fa4 is not None}


def _fa4_runner():
    """FlashAttention-4's forward timed with CUDA events on torch tensors, or None when
    ``flash_attn.cute`` (and a CUDA torch) is not importable here."""
    try:
        import torch
        from flash_attn.cute.interface import flash_attn_func
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None

    def run(B, S, N, D, causal, flops):
        q, k, v = (torch.randn(B, S, N, D, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        try:
            for _ in range(3):
                flash_attn_func(q, k, v, causal=causal)
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(10):
                flash_attn_func(q, k, v, causal=causal)
            end.record()
            torch.cuda.synchronize()
            return flops / (start.elapsed_time(end) / 10 * 1e-3) / 1e12
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:120]}"
    return run


# ------------------------------------------------------------------------------ entry points
def first_run(out_dir: str, skip=(), timeouts=None) -> int:
    """The kit: refuse unless on compute capability 10.0, else every step and the verdict."""
    os.makedirs(out_dir, exist_ok=True)
    dev = device_info()
    path = os.path.join(out_dir, "verdict.json")
    if not is_blackwell(dev):
        v = V.not_blackwell(dev)
        with open(path, "w") as fh:
            json.dump(v, fh, indent=1)
        print(v["message"], file=sys.stderr)
        print(f"verdict: {path}", file=sys.stderr)
        return NOT_BLACKWELL
    os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"  # the run is what checks the gated kernels
    t = dict(tests=600, sanitizer=400, grid=540, **(timeouts or {}))
    rows = [] if "checks" in skip else check(os.path.join(out_dir, "checks.json"))
    tests = {} if "tests" in skip else gpu_tests(out_dir, t["tests"])
    san = {} if "sanitizers" in skip else sanitizers(out_dir, t["sanitizer"])
    g = None if "grid" in skip else grid(os.path.join(out_dir, "grid.json"), t["grid"])
    v = V.verdict(dev, rows, tests, san, g)
    with open(path, "w") as fh:
        json.dump(v, fh, indent=1)
    print(json.dumps({k: v[k] for k in ("status", "checks", "gpu_tests", "features")},
                     indent=1))
    print(f"verdict: {path}")
    return 0 if v["status"] == "pass" else 1


def build(out: str) -> None:
    """Here (DSL installed): compile every variant the check cases and the grid dispatch to on
    sm_100a into `out` (for JAXFLASH_KERNEL_DIR on a Blackwell machine without the DSL)."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from devtools import devrun
    from jaxflash import aot
    os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"
    os.environ["CUTE_DSL_ARCH"] = "sm_100a"
    sds = jax.ShapeDtypeStruct
    launches = {}
    for case in CASES:
        name, _, _, (B, T, S, N, K, H, dtype), ex = case
        fp8 = ex.get("fp8")
        dt = jnp.float8_e4m3fn if fp8 else jnp.dtype(dtype)
        q, k = sds((B, T, N, H), dt), sds((B, S, K, H), dt)
        scales = None
        if fp8:
            nb = lambda L: {"tensor": (), "head": None, "block": -(-L // 128)}[fp8]
            mk = lambda h, L: (sds((), jnp.float32) if fp8 == "tensor" else
                               sds((B, h), jnp.float32) if fp8 == "head" else
                               sds((B, h, nb(L)), jnp.float32))
            scales = (mk(N, T), mk(K, S), mk(K, S))
        slopes, q_seg, kv_seg = devrun._alibi_and_segments(ex, B, T, S, N)
        qs = np.asarray(ex["q_seqlen"], np.int32) if "q_seqlen" in ex else None
        kvs = np.asarray(ex["kv_seqlen"], np.int32) if "kv_seqlen" in ex else None
        kw, _ = _call(name, ex, q, k, k, scales, qs, kvs, slopes, q_seg, kv_seg)
        with jaxflash.target_platform("cuda"):
            plan = jaxflash.explain(q, k, k, **kw)
        if plan.backend != "cute":
            raise SystemExit(f"{name}: not planned on the sm100 kernels: {plan}")
        launches[plan.detail.fwd.key] = plan.detail.fwd
    for _, q, k, kw in _grid_and_test_calls():
        with jaxflash.target_platform("cuda"):
            plan = jaxflash.explain(q, k, k, implementation="cute", **kw)
        if plan.backend != "cute":
            raise SystemExit(f"not planned on the sm100 kernels: {plan}")
        launches[plan.detail.fwd.key] = plan.detail.fwd
    # the 2-CTA forward is never dispatched: its GPU test runs these launches directly
    from jaxflash.kernels.variants.fwd_launch import sm100_fwd_launch
    from tests.kernels.test_sm100_2cta_gpu import CASES as PAIR_CASES
    from tests.kernels.test_sm100_2cta_gpu import pair_config
    for c in PAIR_CASES:
        launch = sm100_fwd_launch(pair_config(c))
        launches[launch.key] = launch
    from jaxflash.kernels.variants.sm100_bwd_launch import pass_launches
    for name, q, k, kw in _bwd_test_calls():
        with jaxflash.target_platform("cuda"):
            plan = jaxflash.explain(q, k, k, implementation="cute", **kw)
        if plan.backend != "cute" or plan.detail.bwd is None:
            raise SystemExit(f"{name}: backward not planned on the sm100 kernel: {plan}")
        launches[plan.detail.fwd.key] = plan.detail.fwd
        for one in pass_launches(plan.detail.bwd):  # hd 256: both passes
            launches[one.key] = one
    counts = aot.build(list(launches.values()), out, progress=False)
    print(f"{counts['built']} built, {counts['kept']} up to date in {out}")


def _bwd_test_calls():
    """(name, q, k(=v), kwargs) of the backward GPU test's cases
    (tests/kernels/test_sm100_bwd_gpu.py: head dims 64 / 128 / 256), for `build`."""
    import jax
    import jax.numpy as jnp
    from tests.kernels.test_sm100_bwd_gpu import CASES
    sds = jax.ShapeDtypeStruct
    out = []
    for name, dtype, (B, T, S, N, K, H), kw in CASES:
        kw = dict(kw)
        for n, L in (("query_seq_lengths", T), ("key_value_seq_lengths", S)):
            if n in kw:
                kw[n] = sds((B,), jnp.int32)
        if "alibi_slopes" in kw:
            kw["alibi_slopes"] = sds((N,), jnp.float32)
        if "segments" in kw:
            kw.pop("segments")
            kw.update(q_segment_ids=sds((B, T), jnp.int32), kv_segment_ids=sds((B, S), jnp.int32))
        dt = jnp.dtype(dtype)
        out.append((name, sds((B, T, N, H), dt), sds((B, S, K, H), dt), kw))
    return out


def _grid_and_test_calls():
    """(name, q, k(=v) ShapeDtypeStructs, kwargs) of the grid's calls and of the GPU test files'
    cases (tests/kernels/test_sm100_gpu.py, test_sm100_fp8_gpu.py), for `build`."""
    import jax
    import jax.numpy as jnp
    sds = jax.ShapeDtypeStruct
    out = []
    for D in (64, 128, 256):
        for causal in (False, True):
            q = sds((1, 4096, 2048 // D, D), jnp.bfloat16)
            out.append((f"grid d{D} c{int(causal)}", q, q, {"is_causal": causal}))
    e4 = jnp.float8_e4m3fn
    q = sds((1, 4096, 16, 128), e4)
    h = sds((1, 16), jnp.float32)
    out.append(("grid fp8 d128", q, q, dict(q_scale=h, k_scale=h, v_scale=h)))
    from tests.kernels.test_fp8_gpu import CASES as FP8_CASES
    from tests.kernels.test_sm100_gpu import CASES as BF16_CASES
    for c in BF16_CASES:
        out.append((str(c), sds((c.B, c.T, c.N, c.H), jnp.dtype(c.dtype)),
                    sds((c.B, c.S, c.K, c.H), jnp.dtype(c.dtype)), dict(c.kwargs)))
    for name, B, T, S, N, K, D, kw, gran in FP8_CASES:
        kw = dict(kw)
        kw.pop("spread", None)          # the test's input magnitudes, not a call argument
        if kw.pop("lengths", False):
            kw.update(query_seq_lengths=sds((B,), jnp.int32),
                      key_value_seq_lengths=sds((B,), jnp.int32))
        sc = lambda heads, L: (sds((), jnp.float32) if gran == "tensor" else
                               sds((B, heads), jnp.float32) if gran == "head" else
                               sds((B, heads, -(-L // 128)), jnp.float32))
        kw.update(q_scale=sc(N, T), k_scale=sc(K, S), v_scale=sc(K, S))
        out.append((name, sds((B, T, N, D), e4), sds((B, S, K, D), e4), kw))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="run", choices=("run", "check", "build"))
    ap.add_argument("--out", required=True, help="results directory (build: kernel directory)")
    ap.add_argument("--cases", help="check: ';'-separated case names (default: all)")
    ap.add_argument("--skip", default="", help="run: comma-separated steps to skip "
                    "(checks, tests, sanitizers, grid)")
    a = ap.parse_args(argv)
    if a.command == "build":
        build(a.out)
        return 0
    if a.command == "check":
        dev = device_info()
        if not is_blackwell(dev):
            print(V.not_blackwell(dev)["message"], file=sys.stderr)
            return NOT_BLACKWELL
        os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"
        rows = check(a.out + ".json", a.cases.split(";") if a.cases else None)
        return 0 if all(r.get("ok") for r in rows) else 1
    return first_run(a.out, tuple(s for s in a.skip.split(",") if s))


if __name__ == "__main__":
    sys.exit(main())
