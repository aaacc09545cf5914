"""Digest of the PTX of the kernel variants dispatch picks (the anchor grid and the feature
cases), compiled through the bridge's own launcher. Used to show that a change that should not
touch the compiled kernels (a move, a comment, a removed knob that was off) leaves every picked
binary's PTX byte-identical.

    CUTE_DSL_ARCH=sm_90a python -m devtools.ptx_digest --out digests.json [--compare old.json]
    CUTE_DSL_ARCH=sm_90a python -m devtools.ptx_digest --out - --build .device/kernels
    CUTE_DSL_ARCH=sm_90a python -m devtools.ptx_digest --only 'alibi|grid-d128-s1024' --out -
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def problems():
    from jaxflash._types import AttentionStatics, Problem
    out = []
    for d in (64, 128, 256):
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                b, n = 16384 // s, 2048 // d
                st = AttentionStatics(scale=d ** -0.5, is_causal=causal, window=None,
                                      softcap=None, deterministic=False)
                out.append((f"grid-d{d}-s{s}-c{int(causal)}",
                            Problem(batch=b, q_len=s, kv_len=s, num_heads=n, num_kv_heads=n,
                                    head_dim=d, head_dim_v=d, dtype="bfloat16", statics=st,
                                    platform="cuda")))
    feats = [
        ("gqa-window-d128", dict(head_dim=128, num_kv_heads=2), dict(window=(64, 0))),
        ("softcap-d128-fp16", dict(head_dim=128, dtype="float16"), dict(softcap=30.0)),
        ("softcap-d64", dict(head_dim=64), dict(softcap=30.0, is_causal=True)),
        ("lengths-d64", dict(head_dim=64, has_q_seqlen=True, has_kv_seqlen=True), {}),
        ("alibi-d64", dict(head_dim=64, has_alibi=True), dict(is_causal=True)),
        ("segments-d128", dict(head_dim=128, has_segments=True), dict(is_causal=True)),
        ("det-d128", dict(head_dim=128), dict(deterministic=True, is_causal=True)),
        ("d192-window", dict(head_dim=192), dict(window=(100, 20))),
        ("d96-causal", dict(head_dim=96), dict(is_causal=True)),
    ]
    for name, pk, sk in feats:
        d = pk.get("head_dim", 128)
        st = AttentionStatics(scale=d ** -0.5, is_causal=sk.get("is_causal", False),
                              window=sk.get("window"), softcap=sk.get("softcap"),
                              deterministic=sk.get("deterministic", False))
        kw = dict(batch=2, q_len=2048, kv_len=2048, num_heads=8, num_kv_heads=8,
                  head_dim=d, head_dim_v=d, dtype="bfloat16", statics=st, platform="cuda")
        kw.update(pk)
        out.append((name, Problem(**kw)))
    return out


def launches():
    from jaxflash.kernels.plan import backward_launch as plan_backward_launch
    from jaxflash.kernels.plan import forward_launch as plan_forward_launch
    seen = {}
    for name, p in problems():
        for what, f in (("fwd", plan_forward_launch), ("bwd", plan_backward_launch)):
            try:
                launch = f(p)
            except NotImplementedError as e:
                print(f"{name} {what}: not served ({e})", file=sys.stderr)
                continue
            seen.setdefault(launch.config.key + "|" + launch.kernel.rpartition(":")[2],
                            (f"{name}-{what}", launch))
    return seen


def ptx_of(launch, tmp):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    from jaxflash.ffi import compiler
    from jaxflash.ffi.variant import TensorArg, load_ref
    args = [compiler._placeholder(t) for t in launch.inputs]
    if launch.scalars:
        args.append(compiler._placeholder(TensorArg("float32", (len(launch.scalars),))))
    if launch.int_scalars:
        args.append(compiler._placeholder(TensorArg("int32", (len(launch.int_scalars),))))
    args += [compiler._placeholder(t) for t in launch.outputs]
    n_scal = bool(launch.scalars) + bool(launch.int_scalars)
    with compiler.target_arch(launch.arch):
        kernel = load_ref(launch.kernel)(launch.config)
        cute.compile(compiler._launcher, cuda.CUstream(0), *args, kernel=kernel,
                     n_in=len(launch.inputs), n_scalar_tensors=n_scal,
                     options=f"--gpu-arch {launch.arch} --keep-ptx --dump-dir {tmp}")
    files = sorted(glob.glob(os.path.join(tmp, "*.ptx")))
    return "".join(open(f).read() for f in files)


def normalize(ptx: str) -> str:
    # Kernel symbols embed the defining module's dotted path (``jaxflashkernelshopper_bwd``
    # + class name): a moved module renames them and nothing else. Debug file / location
    # records, if any, name source paths.
    # The DSL truncates mangled names at a fixed length, so a shorter module path also lets
    # more of the argument signature into the name: every kernel symbol becomes SYM<k>, k in
    # order of first appearance (parameter suffixes kept).
    names: dict[str, str] = {}

    def sym(m):
        base, param = m.group(1), m.group(2) or ""
        return names.setdefault(base, f"SYM{len(names)}") + param

    ptx = re.sub(r"\b(kernel_cutlass_\w+?)(_param_\d+)?\b", sym, ptx)
    return "\n".join(l for l in ptx.splitlines()
                     if not re.match(r"\s*\.(file|loc)\b", l))


def main(argv=None):
    # Plan for CUDA here only: set on import, it would leak into the tests that import ptx_of.
    os.environ.setdefault("JAXFLASH_PLATFORM", "cuda")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="-")
    ap.add_argument("--compare")
    ap.add_argument("--keep", help="directory to keep the PTX in")
    ap.add_argument("--only", help="regex: compile only the cases whose label matches")
    ap.add_argument("--build", help="instead: build these variants' artifacts into this "
                    "directory (what the grid and the feature cases dispatch to)")
    a = ap.parse_args(argv)
    if a.build:
        from jaxflash import aot
        counts = aot.build([l for _, l in launches().values()], a.build, progress=False)
        print(f"{counts['built']} built, {counts['kept']} up to date in {a.build}")
        return 0
    res = {}
    for key, (label, launch) in sorted(launches().items()):
        if a.only and not re.search(a.only, label):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = ptx_of(launch, tmp)
        raw = hashlib.sha256(ptx.encode()).hexdigest()
        norm = hashlib.sha256(normalize(ptx).encode()).hexdigest()
        res[key] = {"label": label, "raw": raw, "normalized": norm, "lines": ptx.count("\n")}
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
            with open(os.path.join(a.keep, re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".ptx"),
                      "w") as f:
                f.write(ptx)
        print(f"{label:28s} {key:70s} {raw[:12]} {norm[:12]}", flush=True)
    if a.out == "-":
        json.dump(res, sys.stdout, indent=1, sort_keys=True)
    else:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    if a.compare:
        old = json.load(open(a.compare))
        bad = [k for k in old if k in res and old[k]["normalized"] != res[k]["normalized"]]
        missing = [k for k in old if k not in res]
        print(f"{len(res)} variants; {len(bad)} differ; {len(missing)} missing")
        for k in bad + missing:
            print("  ", k)
        return 1 if bad or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
