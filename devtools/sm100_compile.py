"""Compile `FlashFwdSm100` for sm_100a without a GPU (CI checks, inspection).

Same fake arguments as the Hopper forward (`devtools.standalone.fake_args`: B, T, S symbolic,
head counts static); ``python -m devtools.sm100_compile [head_dim] [feature ...]`` compiles one
variant and prints where its PTX / cubin went and the time it took.
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


if __name__ == "__main__":
    hd = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    feats = {f: True for f in sys.argv[2:]}
    cfg = Sm100FwdConfig(head_dim=hd, **feats)
    out = os.environ.get("DUMP", "/tmp/sm100_dump")
    os.makedirs(out, exist_ok=True)
    t = time.time()
    compile_fwd_sm100(cfg, num_heads=8, num_kv_heads=2, dump_dir=out)
    print(f"{cfg.key}: {time.time() - t:.1f} s -> {out}")
