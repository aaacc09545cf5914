"""Ahead-of-time compilation of CuTe DSL kernel variants into a directory the runtime reads.

    python -m jaxflash.aot --arch sm_90a --out DIR --kernel sm90_fwd dtype=bfloat16,float16 \\
        head_dim=64,128 is_causal=0,1
    python -m jaxflash.aot --arch sm_90a --out DIR --variant '<json printed by a missing-variant
        error>'
    python -m jaxflash.aot --list

Runs on any machine with the CuTe DSL, GPU or not (the target is ``--arch``, exported to the DSL as
``CUTE_DSL_ARCH``). ``key=v1,v2`` selections are fields of the kernel's config; every combination
is built (the cartesian product), other fields keep their defaults; combinations the config
rejects are reported and skipped. Point ``JAXFLASH_KERNEL_DIR`` at ``DIR`` where the kernels run
(a machine without the DSL needs nothing else). Entries already valid in DIR are kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time


def _parse_value(text: str, default):
    low = text.lower()
    if isinstance(default, bool):
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{text!r} is not a boolean")
    if low == "none":
        return None
    if isinstance(default, int) or default is None:
        try:
            return int(text)
        except ValueError:
            if isinstance(default, int):
                raise
    if isinstance(default, float):
        return float(text)
    return text


def expand(kernel: str, selections: list[str], arch: str):
    """Launches for ``kernel`` over the cartesian product of ``key=v1,v2`` selections, plus
    (description, reason) for each combination the config refuses."""
    from jaxflash.ffi.variant import load_ref
    from jaxflash.kernels import KERNELS
    if kernel not in KERNELS:
        raise SystemExit(f"unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    entry = KERNELS[kernel]
    cfg_ref, launch_ref, archs = entry.config, entry.launch, entry.archs
    if arch not in archs:
        raise SystemExit(f"kernel {kernel!r} is written for {archs}, not {arch}")
    cfg_cls, launch_fn = load_ref(cfg_ref), load_ref(launch_ref)
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else None)
                for f in dataclasses.fields(cfg_cls) if f.init}
    axes = []
    for sel in selections:
        key, eq, vals = sel.partition("=")
        if not eq or key not in defaults:
            raise SystemExit(f"selection {sel!r}: expected FIELD=v1,v2 with FIELD one of "
                             f"{sorted(defaults)}")
        axes.append([(key, _parse_value(v, defaults[key])) for v in vals.split(",")])
    launches, refused = [], []
    for combo in itertools.product(*axes):
        fields = dict(combo)
        try:
            launches.append(launch_fn(cfg_cls(**fields), arch))
        except (ValueError, NotImplementedError) as e:
            refused.append((fields, str(e)))
    return launches, refused


def build(launches, out: str, *, progress=True, log=print) -> dict:
    """Compile `launches` into `out`; returns counts {built, kept}."""
    from jaxflash.ffi import cache
    if not cache.dsl_available():
        raise SystemExit("python -m jaxflash.aot needs the CuTe DSL (pip install "
                         "'nvidia-cutlass-dsl[cu13]==4.8.1'); it is not importable here")
    from jaxflash.ffi import compiler
    version = cache.dsl_version()
    counts = {"built": 0, "kept": 0}
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(launches), unit="variant", file=sys.stderr)
        except ImportError:
            bar = None
    for i, launch in enumerate(launches):
        data, why = cache.read_entry(out, launch, version)
        if data is not None:
            counts["kept"] += 1
            msg = f"up to date  {launch.name}"
        else:
            t0 = time.perf_counter()
            cache.write_entry(out, launch, compiler.compile_launch(launch), version)
            counts["built"] += 1
            msg = f"built {time.perf_counter() - t0:5.1f}s  {launch.name}"
        if bar is not None:
            bar.set_postfix_str(launch.name[:40])
            bar.update(1)
        else:
            log(f"[{i + 1}/{len(launches)}] {msg}")
    if bar is not None:
        bar.close()
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxflash.aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=os.environ.get("CUTE_DSL_ARCH", "sm_90a"),
                   help="target, e.g. sm_90a or sm_100a (default: $CUTE_DSL_ARCH or sm_90a)")
    p.add_argument("--out", help="artifact directory (what JAXFLASH_KERNEL_DIR points at)")
    p.add_argument("--kernel", help="kernel name (see --list)")
    p.add_argument("--variant", action="append", default=[],
                   help="a variant as JSON (as printed by a missing-variant error); repeatable")
    p.add_argument("--list", action="store_true", help="list kernels and their config fields")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("selections", nargs="*", help="FIELD=v1,v2 ... (with --kernel)")
    a = p.parse_args(argv)
    # The DSL reads the target at import; set it before anything imports cutlass.
    os.environ["CUTE_DSL_ARCH"] = a.arch
    if a.list:
        from jaxflash.ffi.variant import load_ref
        from jaxflash.kernels import KERNELS
        for name, entry in KERNELS.items():
            cfg_ref, archs = entry.config, entry.archs
            try:
                fields = [f"{f.name}={f.default!r}" for f in dataclasses.fields(load_ref(cfg_ref))]
            except Exception as e:  # a kernel whose config module is not there yet
                fields = [f"(config unavailable: {e})"]
            print(f"{name}  archs={','.join(archs)}\n    " + " ".join(fields))
        return 0
    if not a.out:
        p.error("--out is required")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out {a.out} is not a directory")
    from jaxflash.ffi.variant import Launch
    launches = []
    for v in a.variant:
        try:
            launch = Launch.from_json(v)
        except (ValueError, TypeError, KeyError, ImportError, AttributeError) as e:
            p.error(f"--variant {v[:80]!r}: not a variant's JSON ({type(e).__name__}: {e})")
        if launch.arch != a.arch:
            p.error(f"--variant is for {launch.arch}, --arch says {a.arch}")
        launches.append(launch)
    refused = []
    if a.kernel:
        try:
            got, refused = expand(a.kernel, a.selections, a.arch)
        except ValueError as e:
            p.error(f"--kernel {a.kernel} {' '.join(a.selections)}: {e}")
        for fields, why in refused:
            print(f"skipped {fields}: {why}", file=sys.stderr)
        launches += got
    elif a.selections:
        p.error("FIELD=values selections need --kernel")
    if not launches:
        p.error("every selected variant was refused (above)" if refused else
                "nothing to build: give --kernel [FIELD=v1,v2 ...] and/or --variant JSON")
    counts = build(launches, a.out, progress=not a.no_progress)
    print(f"{counts['built']} built, {counts['kept']} up to date in {a.out} ({a.arch}); "
          f"run with JAXFLASH_KERNEL_DIR={a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
