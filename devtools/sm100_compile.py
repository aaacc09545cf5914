"""Compile the sm_100a forwards for sm_100a without a GPU (CI checks, inspection).

`compile_fwd_sm100` traces `FlashFwdSm100` on the Hopper forward's fake arguments
(`devtools.standalone.fake_args`: B, T, S symbolic, head counts static); `compile_launch_sm100`
compiles any registered launch (the FP8 forward's, the 2-CTA variants') through the bridge's own
launcher, as `jaxflash.aot` does, keeping PTX and cubin.

    python -m devtools.sm100_compile [head_dim] [feature ...]      (features: config fields set
                                                                   True, plus `fp8`; key=value
                                                                   for other fields)

compiles one variant and prints where its PTX / cubin went (``DUMP``) and the time it took.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import cutlass.cute as cute

from devtools.standalone import fake_args
from jaxflash.kernels.sm100.fwd import FlashFwdSm100
from jaxflash.kernels.variants.sm100_fwd import Sm100FwdConfig


def compile_fwd_sm100(config: Sm100FwdConfig, num_heads: int = 8,
                      num_kv_heads: Optional[int] = None, dump_dir: Optional[str] = None):
    from jaxflash.ffi.compiler import target_arch
    opts = "--gpu-arch sm_100a"
    if dump_dir:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    args = fake_args(config, num_heads, num_kv_heads or num_heads)
    with target_arch("sm_100a"):
        return cute.compile(FlashFwdSm100(config), *args, options=opts)


def compile_launch_sm100(launch, dump_dir: str):
    """Compile a `jaxflash.ffi.Launch` (head counts and lengths dynamic, as the bridge does),
    keeping its PTX and cubin in `dump_dir`."""
    import cuda.bindings.driver as cuda

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
        return cute.compile(compiler._launcher, cuda.CUstream(0), *args, kernel=kernel,
                            n_in=len(launch.inputs), n_scalar_tensors=n_scal,
                            options=f"--gpu-arch {launch.arch} --keep-ptx --keep-cubin "
                                    f"--dump-dir {dump_dir}")


def config_from_argv(argv) -> Sm100FwdConfig:
    hd = int(argv[0]) if argv else 128
    fields, fp8 = {}, False
    for a in argv[1:]:
        if a == "fp8":
            fp8 = True
        elif "=" in a:
            k, v = a.split("=", 1)
            fields[k] = int(v) if v.isdigit() else v
        else:
            fields[a] = True
    if fp8:
        from jaxflash.kernels.variants.sm100_fwd_fp8 import Sm100Fp8FwdConfig
        return Sm100Fp8FwdConfig(head_dim=hd, **fields)
    return Sm100FwdConfig(head_dim=hd, **fields)


if __name__ == "__main__":
    cfg = config_from_argv(sys.argv[1:])
    out = os.environ.get("DUMP", "/tmp/sm100_dump")
    os.makedirs(out, exist_ok=True)
    t = time.time()
    if type(cfg) is Sm100FwdConfig and not cfg.two_cta:
        compile_fwd_sm100(cfg, num_heads=8, num_kv_heads=2, dump_dir=out)
    else:
        from jaxflash.kernels import KERNELS
        from jaxflash.ffi.variant import load_ref
        name = {"Sm100Fp8FwdConfig": "sm100_fwd_fp8",
                "Sm100FwdConfig": "sm100_fwd"}[type(cfg).__name__]
        compile_launch_sm100(load_ref(KERNELS[name].launch)(cfg), out)
    print(f"{cfg.key}: {time.time() - t:.1f} s -> {out}")
