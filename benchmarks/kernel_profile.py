"""GPU time per kernel of one attention call (GPU probe, not a test): where a forward +
backward's time goes, kernel by kernel, from `jax.profiler`'s trace (CUPTI; no Nsight needed).

    python -m benchmarks.kernel_profile --d 128 --s 4096 [--causal] [--fwd-only]

At the grid's shapes (B * S = 16384, N * D = 2048; `fp8_bench.shapes`) it profiles, each in
its own jit: our FP8 kernels on FP8 inputs, precision="fp8" from bf16, and our bf16 kernels,
then (``--helpers-xla``) the FP8 calls again with the XLA forms of the dO quantization and
the keys-major copies. Each is run once, then ``--reps`` times under the profiler; the lines
give the GPU time per call of every kernel, summed over its launches, longest first. The
FP8-input call's optimized HLO fusions are listed too (``--hlo``), to name what a fusion is.

Under Nsight Compute (``--ncu``: each selected call runs twice, without jax.profiler, so that
``ncu --kernel-name regex:... --launch-count 1`` catches one launch of the kernel it names):

    ncu --section WarpStateStats --kernel-name regex:"cutlass_kernel_.*FlashBwd" --launch-count 1 \
        python -m benchmarks.kernel_profile --d 64 --ncu --calls "FP8 inputs, forward + backward"
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile


def kernel_times(f, args, reps: int = 3) -> tuple[float, list]:
    """(GPU microseconds per call, [(kernel name, us per call, launches per call), ...]) of
    the jitted `f` on `args`, longest first."""
    import jax
    jax.block_until_ready(f(*args))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(f(*args))
    found = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {d}")
    trace = json.load(gzip.open(found[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "GPU" in procs.get(e.get("pid"), ""):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    if not total:
        raise RuntimeError(f"no GPU events in the trace (processes {sorted(set(procs.values()))})")
    rows = [(k, t / reps, count[k] // reps) for k, t in total.most_common()]
    return sum(total.values()) / reps, rows


def calls(d: int, s: int, causal: bool, fwd_only: bool):
    """{name: (function, args)} of the calls profiled at grid point (d, s, causal)."""
    import jax
    import jax.numpy as jnp

    import jaxflash
    from benchmarks.fp8_bench import _fp8_args, shapes
    B, S, N, D = shapes(d, s)
    (q, k, v), (q8, k8, v8, qs, ks, vs) = _fp8_args(B, S, N, D)
    do = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.bfloat16)

    def attn(**kw):
        return lambda a, b, c: jaxflash.flash_attention(a, b, c, is_causal=causal,
                                                        implementation="cute", **kw)

    def fwdbwd(f):
        def g(a, b, c, dout):
            o, vjp = jax.vjp(f, a, b, c)
            return vjp(dout)
        return g

    fp8 = attn(q_scale=qs, k_scale=ks, v_scale=vs)
    out = {"FP8 inputs, forward": (lambda a, b, c, _: fp8(a, b, c), (q8, k8, v8, do)),
           "bf16, forward": (lambda a, b, c, _: attn()(a, b, c), (q, k, v, do))}
    if not fwd_only:
        out["FP8 inputs, forward + backward"] = (fwdbwd(fp8), (q8, k8, v8, do))
        out["precision=fp8, forward + backward"] = (fwdbwd(attn(precision="fp8")),
                                                    (q, k, v, do))
        out["bf16, forward + backward"] = (fwdbwd(attn()), (q, k, v, do))
    out.update(_cudnn_fp8_calls(D, causal, fwd_only, (q8, k8, v8, do)))
    return out


def _cudnn_fp8_calls(D: int, causal: bool, fwd_only: bool, args) -> dict:
    """cuDNN's FP8 forward (and, at D 128, forward + backward) as `fp8_bench` times them;
    {} where JAX's entry point is missing."""
    import jax.numpy as jnp

    from benchmarks.fp8_bench import cudnn_fp8_attention, cudnn_fp8_fwdbwd
    try:
        f = cudnn_fp8_attention(D, causal)
    except Exception:  # noqa: BLE001
        return {}
    out = {"cuDNN FP8, forward": (lambda a, b, c, _: f(a, b, c)[0], args)}
    if not fwd_only and D == 128:
        fb = cudnn_fp8_fwdbwd(D, causal)
        out["cuDNN FP8, forward + backward"] = (
            lambda a, b, c, do: fb(a, b, c, do.astype(jnp.float8_e4m3fn)), args)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--helpers-xla", action="store_true",
                    help="also the FP8 calls with XLA's dO quantization and keys-major copies")
    ap.add_argument("--hlo", action="store_true", help="list the FP8-input call's fusions")
    ap.add_argument("--calls", default="",
                    help="only this call (or those whose name starts with this)")
    ap.add_argument("--ncu", action="store_true",
                    help="run each call twice without the profiler (for Nsight Compute)")
    a = ap.parse_args(argv)
    os.environ.setdefault("JAXFLASH_CUTE_UNVERIFIED", "1")
    import jax

    from benchmarks.fp8_bench import KM_IMPL, ROWS_IMPL, _traced_under
    todo_calls = calls(a.d, a.s, a.causal, a.fwd_only)
    todo_calls = ({a.calls: todo_calls[a.calls]} if a.calls in todo_calls else
                  {k: v for k, v in todo_calls.items() if k.startswith(a.calls)})
    todo = [(name, jax.jit(f), args) for name, (f, args) in todo_calls.items()]
    if a.helpers_xla:
        xla = {KM_IMPL: "xla", ROWS_IMPL: "xla"}
        todo += [(name + ", XLA helpers", _traced_under(f, xla), args)
                 for name, (f, args) in todo_calls.items() if name.startswith("FP8")
                 or name.startswith("precision")]
    print(f"D {a.d}, S {a.s}, {'causal' if a.causal else 'dense'}, {jax.devices()[0].device_kind}")
    for name, f, args in todo:
        if a.ncu:
            for _ in range(2):
                jax.block_until_ready(f(*args))
            print(f"== {name}: ran twice")
            continue
        us, rows = kernel_times(f, args, a.reps)
        print(f"== {name}: {us:.1f} us per call on the GPU")
        for k, t, n in rows[:a.top]:
            print(f"  {t:9.1f} us  x{n:<3d} {k[:100]}")
        if a.hlo and name.startswith("FP8 inputs, forward + backward") and "XLA" not in name:
            text = f.lower(*args).compile().as_text()
            for line in text.splitlines():
                if " = " in line and ("fusion(" in line or "custom-call(" in line):
                    print("   HLO:", line.strip()[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
