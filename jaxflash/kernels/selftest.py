"""A deliberately tiny CuTe DSL kernel that exists only to test the FFI bridge (`jaxflash.ffi`).

``out = alpha * x + y`` over 2-D tensors ``[M, N]`` (float32, float16 or bfloat16; arithmetic in
float32), with ``alpha`` a *runtime* scalar read on the device from the float32 scalars tensor.
M and N are dynamic (read from the XLA buffer at run time), so one binary serves every shape of a
dtype. It follows the kernel interface written down in `jaxflash/ffi/__init__.py`.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jaxflash.kernels.variants.selftest import SelfTestConfig

_THREADS = 256


class ScaleAdd:
    """``out[i, j] = alpha * x[i, j] + y[i, j]``, one element per thread (speed is no goal)."""

    def __init__(self, config: SelfTestConfig):
        self.config = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mOut: cute.Tensor,
                 mScalars: cute.Tensor, stream: cuda.CUstream):
        m, n = mX.shape
        total = m * n
        grid = (cute.ceil_div(total, _THREADS), 1, 1)
        self.kernel(mX, mY, mOut, mScalars, total).launch(
            grid=grid, block=(_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, mOut: cute.Tensor,
               mScalars: cute.Tensor, total: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        idx = bidx * _THREADS + tidx
        if idx < total:
            n = mX.shape[1]
            i = idx // n
            j = idx % n
            alpha = mScalars[0]
            acc = alpha * mX[i, j].to(Float32) + mY[i, j].to(Float32)
            mOut[i, j] = acc.to(mOut.element_type)
