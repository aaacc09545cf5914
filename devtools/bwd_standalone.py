"""Compile `FlashBwdSm90` without JAX and without a GPU (CI checks, inspection).

`compile_bwd` compiles the very launch the bridge builds (`bwd_launch`: dynamic batch, lengths
and head counts) through the bridge's own launcher, optionally keeping the PTX in ``dump_dir``.
"""
from __future__ import annotations

from typing import Optional

from jaxflash.kernels.variants.bwd import BwdConfig
from jaxflash.kernels.variants.bwd_launch import bwd_launch


def compile_bwd(config: BwdConfig, arch: str = "sm_90a", dump_dir: Optional[str] = None):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    from jaxflash.ffi.compiler import _launcher, _placeholder, target_arch
    from jaxflash.ffi.variant import TensorArg
    from jaxflash.ffi.variant import load_ref

    launch = bwd_launch(config, arch)
    args = [_placeholder(t) for t in launch.inputs]
    args.append(_placeholder(TensorArg("float32", (len(launch.scalars),))))
    if launch.int_scalars:
        args.append(_placeholder(TensorArg("int32", (len(launch.int_scalars),))))
    args += [_placeholder(t) for t in launch.outputs]
    opts = f"--gpu-arch {arch}"
    if dump_dir:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    with target_arch(arch):
        kernel = load_ref(launch.kernel)(config)  # key split or head-dim split
        return cute.compile(_launcher, cuda.CUstream(0), *args, kernel=kernel,
                            n_in=len(launch.inputs), n_scalar_tensors=1 + bool(launch.int_scalars),
                            options=opts)
