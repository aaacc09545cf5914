"""Compile the FP4 Direct-P forward (`FlashFwdFp4Sm100`) for sm_100a without a GPU.

    python -m devtools.sm100_fp4_compile [policy] [head_dim] [guard_shift]   (DUMP=<dir>)

Fake arguments in the kernel's order (uint8 payloads and scale chunks, float32 score scale and
row reference, bfloat16 output); B, T, S symbolic, head counts static (8 query on 2 K/V heads).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from jaxflash.kernels.sm100.fwd_fp4 import FlashFwdFp4Sm100
from jaxflash.kernels.variants.sm100_fwd_fp4 import Sm100FwdFp4Config


def fake_args(config: Sm100FwdFp4Config, num_heads: int, num_kv_heads: int):
    import cuda.bindings.driver as cuda
    B, T, S = (cute.sym_int32(symbol=s) for s in "BTS")
    MT, NT = cute.sym_int32(symbol="MT"), cute.sym_int32(symbol="NT")
    SP = cute.sym_int32(symbol="SP", divisibility=64)   # padded keys / 2
    h, hv = config.head_dim, config.head_dim_v
    sfq, sfk, sfv = config.sf_bytes()
    u8, f32 = cutlass.Uint8, cutlass.Float32

    def t(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape)))[::-1],
                                        assumed_align=align)
    args = [t(u8, (B, T, num_heads, h // 2)), t(u8, (B, S, num_kv_heads, h // 2)),
            t(u8, (B, num_kv_heads, hv, SP)), t(u8, (B, num_heads, MT, sfq)),
            t(u8, (B, num_kv_heads, NT, sfk)), t(u8, (B, num_kv_heads, NT, sfv)),
            t(f32, (B, num_heads), 4)]
    if config.has_row_ref:
        args.append(t(f32, (B, num_heads, T), 4))
    args += [t(cutlass.BFloat16, (B, T, num_heads, hv)), t(f32, (B, num_heads, T), 4)]
    return tuple(args) + (cuda.CUstream(0),)


def compile_fwd_fp4(config: Sm100FwdFp4Config, num_heads: int = 8,
                    num_kv_heads: Optional[int] = None, dump_dir: Optional[str] = None):
    from jaxflash.ffi.compiler import target_arch
    opts = "--gpu-arch sm_100a"
    if dump_dir:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    args = fake_args(config, num_heads, num_kv_heads or num_heads)
    with target_arch("sm_100a"):
        return cute.compile(FlashFwdFp4Sm100(config), *args, options=opts)


if __name__ == "__main__":
    a = sys.argv[1:]
    cfg = Sm100FwdFp4Config(policy=a[0] if a else "fast",
                            head_dim=int(a[1]) if len(a) > 1 else 128,
                            guard_shift=int(a[2]) if len(a) > 2 else None)
    out = os.environ.get("DUMP", "/tmp/sm100_fp4_dump")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    compile_fwd_fp4(cfg, num_heads=8, num_kv_heads=2, dump_dir=out)
    print(f"{cfg.key}: {time.time() - t0:.1f} s -> {out}")
