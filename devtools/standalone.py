"""Compile `FlashFwdSm90` without JAX and without a GPU (CI checks, artifacts, inspection).

`compile_fwd` traces the kernel on fake tensors whose batch and sequence lengths are symbolic, so
one binary serves every B, T, S (what the XLA bridge relies on). The head counts and head dims
are static here. Set the architecture with ``arch`` (passed as ``--gpu-arch``; the DSL also
reads ``CUTE_DSL_ARCH``, which must match when no GPU is present).
"""
from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from jaxflash.kernels.variants.fwd import FwdConfig
from jaxflash.kernels.sm90.fwd import FlashFwdSm90, _DTYPES


def fake_args(config: FwdConfig, num_heads: int, num_kv_heads: int):
    """Fake arguments in `FlashFwdSm90.__call__` order (the bridge's), B/T/S symbolic."""
    import cuda.bindings.driver as cuda

    dt = _DTYPES[config.dtype]
    B = cute.sym_int32(symbol="B")
    T = cute.sym_int32(symbol="T")
    S = cute.sym_int32(symbol="S")
    row_major = (3, 2, 1, 0)  # [B, T, N, H]: H fastest
    q = make_fake_compact_tensor(dt, (B, T, num_heads, config.head_dim), stride_order=row_major,
                                 assumed_align=16)
    k = make_fake_compact_tensor(dt, (B, S, num_kv_heads, config.head_dim),
                                 stride_order=row_major, assumed_align=16)
    v = make_fake_compact_tensor(dt, (B, S, num_kv_heads, config.head_dim_v),
                                 stride_order=row_major, assumed_align=16)
    o = make_fake_compact_tensor(dt, (B, T, num_heads, config.head_dim_v),
                                 stride_order=row_major, assumed_align=16)
    lse = make_fake_compact_tensor(cutlass.Float32, (B, num_heads, T), stride_order=(2, 1, 0),
                                   assumed_align=4)
    qlen = (make_fake_compact_tensor(cutlass.Int32, (B,), assumed_align=4)
            if config.has_q_seqlen else None)
    kvlen = (make_fake_compact_tensor(cutlass.Int32, (B,), assumed_align=4)
             if config.has_kv_seqlen else None)
    extra = []
    if config.has_alibi:
        extra.append(make_fake_compact_tensor(cutlass.Float32, (1, num_heads),
                                              stride_order=(1, 0), assumed_align=4))
    if config.has_segments:
        nm = cute.sym_int32(symbol="NM")
        nn = cute.sym_int32(symbol="NN")
        extra += [make_fake_compact_tensor(cutlass.Int32, shape, stride_order=order,
                                           assumed_align=4)
                  for shape, order in (((B, T), (1, 0)), ((B, S), (1, 0)),
                                       ((B, nm, 4), (2, 1, 0)), ((B, nn, 2), (2, 1, 0)))]
    fs = make_fake_compact_tensor(cutlass.Float32, (2,), assumed_align=4)
    is_ = make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=4)
    args = [q, k, v] + [t for t in (qlen, kvlen) if t is not None] + extra + [o, lse, fs]
    if config.has_window:
        args.append(is_)
    return tuple(args) + (cuda.CUstream(0),)


def compile_fwd(config: FwdConfig, num_heads: int = 16, num_kv_heads: Optional[int] = None,
                arch: str = "sm_90a", dump_dir: Optional[str] = None):
    """Compile one variant; with ``dump_dir`` keep the PTX (and cubin) there for inspection."""
    from jaxflash.ffi.compiler import target_arch
    kernel = FlashFwdSm90(config)
    opts = f"--gpu-arch {arch}"
    if dump_dir:
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    args = fake_args(config, num_heads, num_kv_heads or num_heads)
    with target_arch(arch):  # the process may have targeted another arch before
        return cute.compile(kernel, *args, options=opts)
