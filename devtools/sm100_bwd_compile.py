"""Compile `FlashBwdSm100` for sm_100a without a GPU (CI checks, inspection).

Compiles the very launch the bridge builds (`sm100_bwd_launch`: dynamic batch, lengths and
head counts) through the bridge's own launcher, like `devtools.bwd_standalone` for Hopper.
``python -m devtools.sm100_bwd_compile [head_dim] [feature | FIELD=value ...]`` compiles one
variant and prints where its PTX / cubin went and the time it took.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

from jaxflash.kernels.variants.sm100_bwd import Sm100BwdConfig
from jaxflash.kernels.variants.sm100_bwd_launch import sm100_bwd_launch


def compile_bwd_sm100(config: Sm100BwdConfig, dump_dir: Optional[str] = None):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    from jaxflash.ffi.compiler import _launcher, _placeholder, target_arch
    from jaxflash.ffi.variant import TensorArg, load_ref

    launch = sm100_bwd_launch(config)
    args = [_placeholder(t) for t in launch.inputs]
    args.append(_placeholder(TensorArg("float32", (len(launch.scalars),))))
    if launch.int_scalars:
        args.append(_placeholder(TensorArg("int32", (len(launch.int_scalars),))))
    args += [_placeholder(t) for t in launch.outputs]
    opts = "--gpu-arch sm_100a"
    if dump_dir:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    with target_arch("sm_100a"):
        kernel = load_ref(launch.kernel)(config)
        return cute.compile(_launcher, cuda.CUstream(0), *args, kernel=kernel,
                            n_in=len(launch.inputs),
                            n_scalar_tensors=1 + bool(launch.int_scalars), options=opts)


if __name__ == "__main__":
    hd = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    # a feature name turns it on; FIELD=value sets a string field (dtype=float16,
    # bwd_pass=dkdq: the hd 256 passes; the default is the first)
    feats = dict(a.split("=", 1) if "=" in a else (a, True) for a in sys.argv[2:])
    cfg = Sm100BwdConfig(head_dim=hd, **feats)
    out = os.environ.get("DUMP", "/tmp/sm100_bwd_dump")
    os.makedirs(out, exist_ok=True)
    t = time.time()
    compile_bwd_sm100(cfg, dump_dir=out)
    print(f"{cfg.key}: {time.time() - t:.1f} s -> {out}")
