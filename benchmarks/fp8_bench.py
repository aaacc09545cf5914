"""FP8 forward speed on the H200: our FP8 kernel (`FlashFwdSm90Fp8`, e4m3 in, bf16 out, per-tensor
scales) beside our bf16 forward, cuDNN's FP8 forward (JAX's private entry point, e4m3 in and
out) and our ``precision="fp8"`` from bf16 (Hadamard + block quantization in XLA, then the
kernel), all in one process, interleaved per grid point (`timing.time_interleaved`).

    python -m benchmarks.fp8_bench build --out .device/kernels     # here: compile the variants
    python -m benchmarks.fp8_bench run [--quick] [--out DIR]         # on the GPU
    python -m benchmarks.fp8_bench run --tiles                       # key tiles compared
    python -m benchmarks.fp8_bench run --bwd [--dims 256]            # forward + backward
    python -m benchmarks.fp8_bench build --bwd --out .device/kernels # only what --bwd and
                                               # tests/kernels/test_fp8_bwd_gpu.py reach

Grid (FlashAttention-3's): B * S = 16384, N * D = 2048, D in 64 / 128 / 256, S in 1k / 4k / 16k,
dense and causal. TFLOP/s = 4 B N S^2 D / time (halved when causal). ``build`` also compiles the
variants of tests/kernels/test_fp8_gpu.py (by asking dispatch what it would run, as the GPU will).
Results: ``fp8-fwd-bench-h200-<date>.json`` and ``.md`` in --out (default $OUT or
benchmarks/results). The issue's targets are printed with the table: FP8 geomean >= 1.1x cuDNN
FP8, >= 1200 TFLOP/s at D 256 S 16k dense, >= 1.5x our bf16 at S >= 4k (D 128 / 256).

``run --bwd``: forward + backward at D 128 and 256 (`BWD_POINTS`): ours FP8 (FP8 operands and scales
given, gradients with respect to them: the FP8 forward and backward kernels), ours
``precision="fp8"`` from bf16 (quantize + Hadamard in XLA, gradients to the bf16 inputs), ours
bf16, cuDNN FP8 (vjp of JAX's private FP8 entry point, D 128 only: its FP8 backward runs at no
other head dim; the timing does not depend on its scale order bug, see ../shared/anchors/fp8/),
TFLOP/s = 3.5 x the forward's FLOPs / time. Results:
``fp8-fwdbwd-bench-h200-<date>.json`` / ``.md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

GRID = [(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (False, True)]
QUICK = [(d, s, c) for d in (128, 256) for s in (4096, 16384) for c in (False, True)]
# `run --tiles`: FP8 variants beside the pick (per-tensor scales: block scales need the
# contract's 128-key tiles; V^T from the XLA side in every one, as picked): at hd 64 the
# 128-row tiles beside the 192-row pick (three consumer warpgroups), the persistent tile loop
# (the bf16 kernel's gain at S = 1k), wider key tiles (FlashAttention-3's FP8 choice at hd 128
# is 224), and the conditional O rescale (FlashAttention-4's, bitwise the same result).
BWD_POINTS = [(128, s, c) for s in (1024, 4096, 16384) for c in (False, True)]
# hd 256 (`FlashBwdSm90Fp8Wide`): beside our bf16 forward + backward only (no cuDNN FP8 backward)
BWD_POINTS += [(256, s, c) for s in (4096, 16384) for c in (False, True)]
# hd 64 from 4k (the grid's points the forward + backward target covers)
BWD_POINTS += [(64, s, c) for s in (4096, 16384) for c in (False, True)]
TILE_POINTS = [(d, s, c) for d in (64, 128) for s in (1024, 4096, 16384) for c in (False, True)]
TILE_POINTS += [(256, s, c) for s in (4096, 16384) for c in (False, True)]
TILE_VARIANTS = {
    64: {"pick": {}, "m128": dict(tile_m=128), "persistent": dict(persistent=True),
         "lazy": dict(lazy_rescale=True)},
    128: {"pick": {}, "t160": dict(tile_n=160), "t192": dict(tile_n=192),
          "persistent": dict(persistent=True), "lazy": dict(lazy_rescale=True)},
    256: {"pick": {}, "lazy": dict(lazy_rescale=True)},
}


def tile_launch(d, s, c, **change):
    """The FP8 launch dispatch picks for grid point (d, s, c) with per-tensor scales, with the
    config fields in `change` replaced."""
    import dataclasses

    from jaxflash._types import AttentionStatics, Fp8Spec, Problem
    from jaxflash.kernels.policy.choose import fp8_forward_config
    from jaxflash.kernels.variants.fwd_fp8_launch import fwd_fp8_launch
    B, S, N, D = shapes(d, s)
    spec = Fp8Spec(q_block=S, k_block=S, v_block=S, granularity=("tensor",) * 3)
    st = AttentionStatics(scale=D ** -0.5, is_causal=c, fp8=spec)
    p = Problem(batch=B, q_len=S, kv_len=S, num_heads=N, num_kv_heads=N, head_dim=D,
                head_dim_v=D, dtype="float8_e4m3fn", statics=st, platform="cuda")
    cfg = fp8_forward_config(p)
    if change.get("tile_m") == 128 and cfg.tile_m != 128:   # the 128-row tiles' causal pick
        change = dict(change, mask_select=c)
    return fwd_fp8_launch(dataclasses.replace(cfg, **change)), st


def shapes(d, s):
    return 16384 // s, s, 2048 // d, d  # B, S, N, D


def _fp8_args(B, S, N, D, K=None, seed=0):
    import jax
    import jax.numpy as jnp

    from jaxflash import quantize as Q
    K = K or N
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, S, N, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, K, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, K, D), jnp.bfloat16)
    q8, qs = Q.quantize(q, jnp.float8_e4m3fn, granularity="tensor")
    k8, kss = Q.quantize(k, jnp.float8_e4m3fn, granularity="tensor")
    v8, vs = Q.quantize(v, jnp.float8_e4m3fn, granularity="tensor")
    return (q, k, v), (q8, k8, v8, qs, kss, vs)


def build(out: str, bwd_only: bool = False, dims=None) -> int:
    """Compile our FP8 and bf16 forward variants of the grid and the FP8 GPU tests' cases, and
    the forward + backward variants of `BWD_POINTS` (``bwd_only``: those and the FP8 backward
    GPU test's cases only)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["JAXFLASH_PLATFORM"] = "cuda"
    os.environ["JAXFLASH_CUTE_UNVERIFIED"] = "1"
    import jax
    import jax.numpy as jnp

    import jaxflash
    from jaxflash import aot
    from tests.kernels.test_fp8_gpu import CASES, PRECISION_CASES
    sds = jax.ShapeDtypeStruct
    launches = {}

    def add(plan, bwd=False):
        launches.setdefault(plan.detail.fwd.name, plan.detail.fwd)
        b = getattr(plan.detail, "bwd", None)  # the backward launches of the fwd+bwd points
        if b is not None and (bwd or (plan.problem.head_dim, plan.problem.kv_len, plan.problem.
                                      statics.is_causal) in [(d, s, c) for d, s, c in BWD_POINTS]):
            launches.setdefault(b.name, b)

    e4 = jnp.float8_e4m3fn
    for d, s, c in (_only(BWD_POINTS, dims) if bwd_only else GRID):
        B, S, N, D = shapes(d, s)
        x8 = sds((B, S, N, D), e4)
        one = jnp.ones((), jnp.float32)
        add(jaxflash.explain(x8, x8, x8, q_scale=one, k_scale=one, v_scale=one, is_causal=c,
                             implementation="cute"))
        xb = sds((B, S, N, D), jnp.bfloat16)
        add(jaxflash.explain(xb, xb, xb, is_causal=c, implementation="cute"))
        add(jaxflash.explain(xb, xb, xb, is_causal=c, precision="fp8", implementation="cute"))
    for name, B, T, S, N, K, D, kw, gran in ([] if bwd_only else CASES):
        kw = dict(kw)
        kw.pop("spread", None)          # the test's input magnitudes, not a call argument
        if kw.pop("lengths", False):
            kw.update(query_seq_lengths=jnp.full((B,), T, jnp.int32),
                      key_value_seq_lengths=jnp.full((B,), S, jnp.int32))

        def sc(h, L):
            shape = {"tensor": (), "head": (B, h), "block": (B, h, -(-L // 128))}[gran]
            return jnp.ones(shape, jnp.float32)

        add(jaxflash.explain(sds((B, T, N, D), e4), sds((B, S, K, D), e4), sds((B, S, K, D), e4),
                             q_scale=sc(N, T), k_scale=sc(K, S), v_scale=sc(K, S),
                             implementation="cute", **kw))
    for name, B, T, S, N, K, D, kw in ([] if bwd_only else PRECISION_CASES):
        add(jaxflash.explain(sds((B, T, N, D), jnp.bfloat16), sds((B, S, K, D), jnp.bfloat16),
                             sds((B, S, K, D), jnp.bfloat16), precision="fp8",
                             implementation="cute", **kw))
    from tests.kernels.test_fp8_bwd_gpu import CASES as BWD_CASES
    for name, B, T, S, N, K, D, kw in BWD_CASES:
        kw = dict(kw)
        if kw.pop("lengths", False):
            kw.update(query_seq_lengths=jnp.full((B,), T, jnp.int32),
                      key_value_seq_lengths=jnp.full((B,), S, jnp.int32))
        if kw.pop("segments", False):
            kw.update(q_segment_ids=jnp.zeros((B, T), jnp.int32),
                      kv_segment_ids=jnp.zeros((B, S), jnp.int32))
        if kw.get("dout_dtype") == "e4m3":
            kw["dout_dtype"] = e4
        add(jaxflash.explain(sds((B, T, N, D), jnp.bfloat16), sds((B, S, K, D), jnp.bfloat16),
                             sds((B, S, K, D), jnp.bfloat16), precision="fp8",
                             implementation="cute", **kw), bwd=True)
    for d, s_, c in ([] if bwd_only else TILE_POINTS):
        for change in TILE_VARIANTS[d].values():
            launch, _ = tile_launch(d, s_, c, **change)
            launches.setdefault(launch.name, launch)
    counts = aot.build(list(launches.values()), out, progress=True)
    print(f"{counts['built']} built, {counts['kept']} up to date in {out}")
    return 0


def run(points, out_dir: str) -> int:
    import jax

    import jaxflash
    from benchmarks import envinfo
    from benchmarks.timing import time_interleaved
    os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except Exception as e:  # noqa: BLE001
        fa = None
        print(f"cuDNN FP8 entry point unavailable: {e}")
    rows = []
    env = envinfo.collect()       # once: it runs nvidia-smi and git
    for d, s, c in points:
        B, S, N, D = shapes(d, s)
        (q, k, v), (q8, k8, v8, qs, ks, vs) = _fp8_args(B, S, N, D)
        args = (q, k, v, q8, k8, v8, qs, ks, vs)
        fns = {
            "ours_fp8": jax.jit(lambda q, k, v, q8, k8, v8, qs, ks, vs: jaxflash.flash_attention(
                q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs, is_causal=c,
                implementation="cute")),
            "ours_bf16": jax.jit(lambda q, k, v, *_: jaxflash.flash_attention(
                q, k, v, is_causal=c, implementation="cute")),
            # precision="fp8" from bf16: the library's prologue (Hadamard, 128-row block
            # quantization) + kernel
            "ours_fp8_e2e": jax.jit(lambda q, k, v, *_: jaxflash.flash_attention(
                q, k, v, is_causal=c, precision="fp8", implementation="cute")),
        }
        if fa is not None:
            cudnn = cudnn_fp8_attention(D, c)
            fns["cudnn_fp8"] = jax.jit(lambda q, k, v, q8, k8, v8, *_: cudnn(q8, k8, v8)[0])
        ok = {}
        for name, f in fns.items():
            try:
                jax.block_until_ready(f(*args))
                ok[name] = f
            except Exception as e:  # noqa: BLE001
                print(f"d{d} s{s} c{int(c)} {name}: failed: {type(e).__name__}: {str(e)[:300]}")
        t = time_interleaved(ok, args, reps=5, min_rep_s=0.02)
        fl = 4.0 * B * N * S * S * D / (2 if c else 1)
        row = dict(D=d, S=s, causal=c, B=B, N=N)
        for name in fns:
            row[name] = fl / t[name].median_s / 1e12 if name in t else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write_fwd(out_dir, env, rows)   # after every row: a run cut short keeps them
    print(json.dumps(_summary(rows)))
    print(_write_fwd(out_dir, env, rows))
    return 0


def _write_fwd(out_dir, env, rows) -> str:
    summary = _summary(rows)
    date = datetime.date.today().isoformat()
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"fp8-fwd-bench-h200-{date}")
    with open(base + ".json", "w") as f:
        json.dump({"env": env, "rows": rows, "summary": summary}, f, indent=1)
    text = _table(rows, summary)
    with open(base + ".md", "w") as f:
        f.write(text)
    return text


def run_tiles(out_dir: str) -> int:
    """TFLOP/s of the FP8 kernel's variants (`TILE_VARIANTS`) on `TILE_POINTS`, interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import envinfo
    from benchmarks.timing import time_interleaved
    from jaxflash._types import AttentionArrays
    from jaxflash.kernels import call
    rows = []
    for d, s, c in TILE_POINTS:
        B, S, N, D = shapes(d, s)
        _, (q8, k8, v8, qs, ks, vs) = _fp8_args(B, S, N, D)
        fns = {}
        for name, change in TILE_VARIANTS[d].items():
            launch, st = tile_launch(d, s, c, **change)
            fns[name] = jax.jit(
                lambda q8, k8, v8, qs, ks, vs, launch=launch, st=st: call.forward_fp8(
                    launch, q8, k8, v8, AttentionArrays(
                        q_scale=jnp.broadcast_to(qs, (B, N, 1)),
                        k_scale=jnp.broadcast_to(ks, (B, N, 1)),
                        v_scale=jnp.broadcast_to(vs, (B, N, 1))), st)[0])
        args = (q8, k8, v8, qs, ks, vs)
        ok = {}
        for name, f in fns.items():
            try:
                jax.block_until_ready(f(*args))
                ok[name] = f
            except Exception as e:  # noqa: BLE001
                print(f"d{d} s{s} c{int(c)} {name}: failed: {type(e).__name__}: {str(e)[:300]}")
        t = time_interleaved(ok, args, reps=5, min_rep_s=0.02) if ok else {}
        fl = 4.0 * B * N * S * S * D / (2 if c else 1)
        row = dict(D=d, S=s, causal=c, **{k: (fl / t[k].median_s / 1e12 if k in t else None)
                                          for k in fns})
        if "pick" in ok:  # each variant's output against the pick's (checked) output
            ref = np.asarray(ok["pick"](*args), np.float32)
            for k in ok:
                if k != "pick":
                    o = np.asarray(ok[k](*args), np.float32)
                    row[k + "_rel_vs_pick"] = float(np.linalg.norm(o - ref)
                                                    / np.linalg.norm(ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    date = datetime.date.today().isoformat()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"fp8-fwd-tiles-h200-{date}.json"), "w") as f:
        json.dump({"env": envinfo.collect(), "rows": rows}, f, indent=1)
    return 0


def run_bwd(points, out_dir: str) -> int:
    """Forward + backward TFLOP/s at `points`: ours FP8 (kernels both ways), ours precision=
    "fp8" from bf16, ours bf16, cuDNN FP8, interleaved per point."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from benchmarks import envinfo
    from benchmarks.timing import time_interleaved
    os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except Exception as e:  # noqa: BLE001
        fa = None
        print(f"cuDNN FP8 entry point unavailable: {e}")
    f32 = jnp.float32
    rows = []
    env = envinfo.collect()       # once: it runs nvidia-smi and git
    for d, s, c in points:
        B, S, N, D = shapes(d, s)
        (q, k, v), (q8, k8, v8, qs, ks, vs) = _fp8_args(B, S, N, D)
        do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.bfloat16)
        do8 = do.astype(jnp.float8_e4m3fn)
        args = (q, k, v, do, q8, k8, v8, qs, ks, vs, do8)

        def ours_fp8(q, k, v, do, q8, k8, v8, qs, ks, vs, do8):
            def f(a, b, e):
                return jaxflash.flash_attention(a, b, e, q_scale=qs, k_scale=ks, v_scale=vs,
                                                is_causal=c, implementation="cute")
            o, vjp = jax.vjp(f, q8, k8, v8)
            return vjp(do)

        def ours(prec):
            def fb(q, k, v, do, *_):
                def loss(a, b, e):
                    o = jaxflash.flash_attention(a, b, e, is_causal=c, precision=prec,
                                                 implementation="cute")
                    return jnp.sum(o.astype(f32) * do.astype(f32))
                return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
            return fb

        fns = {"ours_fp8": jax.jit(ours_fp8), "ours_fp8_e2e": jax.jit(ours("fp8")),
               "ours_bf16": jax.jit(ours(None))}
        # Candidates traced under other settings (picked when the call is traced): the XLA
        # forms of the FP8 helpers (dO quantization, `prologue.ROWS_IMPL`; the keys-major copies
        # V^T, Q^T, K^T, dO^T, `keys_major.IMPL`) in place of their Triton kernels; and
        # precision="fp8" with the butterfly prologue and the butterflies' transpose backward.
        xla = {KM_IMPL: "xla", ROWS_IMPL: "xla"}
        variants = {"ours_fp8_xla_helpers": (ours_fp8, xla),
                    "ours_fp8_e2e_xla_helpers": (ours("fp8"), xla),
                    "ours_fp8_e2e_butterflies": (ours("fp8"), {PROLOGUE_IMPL: "triton"})}
        for name, (fn, settings) in variants.items():
            fns[name] = _traced_under(fn, settings)
        if fa is not None and d == 128:  # (cuDNN's FP8 backward: D 128 only)
            fb = cudnn_fp8_fwdbwd(D, c)
            fns["cudnn_fp8"] = jax.jit(lambda q, k, v, do, q8, k8, v8, qs, ks, vs, do8:
                                       fb(q8, k8, v8, do8))
        ok = {}
        for name, f in fns.items():
            try:
                jax.block_until_ready(f(*args))
                ok[name] = f
            except Exception as e:  # noqa: BLE001
                print(f"d{d} s{s} c{int(c)} {name}: failed: {type(e).__name__}: {str(e)[:300]}")
        t = time_interleaved(ok, args, reps=5, min_rep_s=0.02) if ok else {}
        fl = 3.5 * 4.0 * B * N * S * S * D / (2 if c else 1)
        row = dict(D=d, S=s, causal=c, B=B, N=N)
        for name in fns:
            row[name] = fl / t[name].median_s / 1e12 if name in t else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write_bwd(out_dir, env, rows)    # after every row: a run cut short keeps them
    print(_write_bwd(out_dir, env, rows))
    return 0


def cudnn_fp8_attention(D: int, causal: bool, p_scale: float = 1.0):
    """cuDNN's FP8 attention through JAX's private entry point: f(q8, k8, v8) -> (o8, amax_s,
    amax_o), every scale 1 but P's quantization scale (`p_scale`; the forward + backward takes
    256, as ../shared/anchors/fp8's bench does)."""
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    params = {k: one for k in fa.fp8_params_keys}
    params.update(scale_s=one * p_scale, descale_s=one / p_scale)
    mt = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return lambda q8, k8, v8: fa.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=D ** -0.5, mask_type=mt, qkv_layout="BTNH",
        use_fp8=True)


def cudnn_fp8_fwdbwd(D: int, causal: bool):
    """cuDNN's FP8 forward + backward: g(q8, k8, v8, do8) -> (dq, dk, dv) (D 128 only)."""
    import jax
    import jax.numpy as jnp
    f = cudnn_fp8_attention(D, causal, p_scale=256.0)

    def g(q8, k8, v8, do8):
        _, vjp = jax.vjp(f, q8, k8, v8)
        z = jnp.zeros((1, 1, 1, 1), jnp.float32)
        return vjp((do8, z, z))
    return g


# Module constants the benches set while a variant traces (`_traced_under`).
KM_IMPL = "jaxflash.kernels.variants.keys_major.IMPL"
ROWS_IMPL = "jaxflash.fp8.prologue.ROWS_IMPL"
PROLOGUE_IMPL = "jaxflash.fp8.prologue.IMPL"


def _traced_under(fn, settings: dict):
    """`fn` jitted with the module constants of `settings` (``"package.module.NAME": value``)
    set while it traces (its first call per shape; the timed calls reuse that trace). The jit
    wraps a function object of its own: jit (jax 0.10-0.11) shares one function's trace across
    its wrappers, so `fn`, traced before under the defaults, would keep them."""
    import importlib

    import jax
    f = jax.jit(lambda *args: fn(*args))

    def g(*args):
        saved = []
        for key, value in settings.items():
            mod, attr = key.rsplit(".", 1)
            m = importlib.import_module(mod)
            saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, value)
        try:
            return f(*args)
        finally:
            for m, attr, value in reversed(saved):
                setattr(m, attr, value)
    return g


def _write_bwd(out_dir, env, rows) -> str:
    cols = ["ours_fp8", "ours_fp8_xla_helpers", "ours_fp8_e2e", "ours_fp8_e2e_xla_helpers",
            "ours_fp8_e2e_butterflies", "ours_bf16", "cudnn_fp8"]
    lines = ["| D | S | causal | " + " | ".join(cols) + " | FP8/bf16 | FP8/cuDNN FP8 |",
             "|---|---|---|" + "---|" * (len(cols) + 2)]
    f = lambda x: "" if x is None else f"{x:.0f}"
    g = lambda a, b: f"{a / b:.2f}" if a and b else ""
    for r in rows:
        lines.append(f"| {r['D']} | {r['S']} | {int(r['causal'])} | "
                     + " | ".join(f(r.get(c)) for c in cols)
                     + f" | {g(r.get('ours_fp8'), r['ours_bf16'])} | "
                     f"{g(r.get('ours_fp8'), r.get('cudnn_fp8'))} |")
    table = ("\n".join(lines) + "\n\nTFLOP/s, forward + backward (3.5 x the forward's FLOPs); "
             "ours_fp8 / ours_fp8_e2e as the library runs them, *_xla_helpers with the XLA forms "
             "of the dO quantization and keys-major copies.\n")
    date = datetime.date.today().isoformat()
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"fp8-fwdbwd-bench-h200-{date}")
    with open(base + ".json", "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)
    with open(base + ".md", "w") as fh:
        fh.write(table)
    return table


def _only(points, dims):
    """`points` at the head dims of the comma-separated `dims` (all when None)."""
    if not dims:
        return points
    keep = {int(x) for x in str(dims).split(",")}
    return [p for p in points if p[0] in keep]


def _gm(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _summary(rows):
    def ratio(r, a, b):
        return r[a] / r[b] if r.get(a) and r.get(b) else None
    vs_cudnn = [ratio(r, "ours_fp8", "cudnn_fp8") for r in rows]
    vs_bf16 = [ratio(r, "ours_fp8", "ours_bf16") for r in rows if r["S"] >= 4096
               and r["D"] in (128, 256)]
    e2e = [ratio(r, "ours_fp8_e2e", "ours_bf16") for r in rows if r["S"] >= 4096]
    d256 = [r["ours_fp8"] for r in rows if r["D"] == 256 and r["S"] == 16384 and not r["causal"]]
    return {"geomean_fp8_vs_cudnn_fp8": _gm(vs_cudnn), "target_vs_cudnn": 1.1,
            "min_fp8_vs_bf16_S>=4k_D128/256": min([x for x in vs_bf16 if x], default=None),
            "geomean_fp8_vs_bf16_S>=4k_D128/256": _gm(vs_bf16), "target_vs_bf16": 1.5,
            "d256_s16k_dense_tflops": d256[0] if d256 else None, "target_d256_tflops": 1200,
            "min_fp8_e2e_vs_bf16_S>=4k": min([x for x in e2e if x], default=None),
            "target_e2e_vs_bf16": 1.25}


def _table(rows, summary):
    f = lambda x: "" if x is None else f"{x:.0f}"
    g = lambda x: "" if x is None else f"{x:.2f}"
    lines = ["| D | S | causal | ours FP8 | ours bf16 | cuDNN FP8 | ours precision=fp8 from bf16 "
             "| FP8/cuDNN FP8 | FP8/bf16 | e2e/bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b, c, e = r["ours_fp8"], r["ours_bf16"], r.get("cudnn_fp8"), r.get("ours_fp8_e2e")
        lines.append(f"| {r['D']} | {r['S']} | {int(r['causal'])} | {f(a)} | {f(b)} | {f(c)} | "
                     f"{f(e)} | {g(a / c if a and c else None)} | {g(a / b if a and b else None)} | "
                     f"{g(e / b if e and b else None)} |")
    lines.append("")
    lines.append("TFLOP/s. " + ", ".join(f"{k}: {g(v) if isinstance(v, float) else v}"
                                         for k, v in summary.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("build", "run"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="D 128 / 256, S 4k / 16k only")
    ap.add_argument("--bwd", action="store_true",
                    help="instead: forward + backward at D 128 / 256 (BWD_POINTS)")
    ap.add_argument("--dims", default=None,
                    help="with --bwd: only these head dims (comma separated, e.g. 256)")
    ap.add_argument("--tiles", action="store_true",
                    help="instead: FP8 variants compared (TILE_POINTS x TILE_VARIANTS)")
    a = ap.parse_args(argv)
    if a.mode == "build":
        return build(a.out or ".device/kernels", bwd_only=a.bwd, dims=a.dims)
    out = a.out or os.environ.get("OUT") or "benchmarks/results"
    if a.tiles:
        return run_tiles(out)
    if a.bwd:
        return run_bwd(_only(BWD_POINTS, a.dims), out)
    return run(QUICK if a.quick else GRID, out)


if __name__ == "__main__":
    sys.exit(main())
