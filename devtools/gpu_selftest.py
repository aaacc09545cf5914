"""Prepare the bridge's GPU self-test on a machine WITHOUT a GPU (it needs the CuTe DSL):

    python -m devtools.gpu_selftest artifacts/ffi_selftest

writes ``kernels/`` (the self-test kernel for sm_90a in every dtype, what JAXFLASH_KERNEL_DIR
points at) and ``*.jaxexport`` + ``*.npz`` (jax.export artifacts made here, with inputs and
expected outputs) that tests/test_ffi_gpu.py runs on the GPU machine. Recipe: README.md here.
"""
from __future__ import annotations

import os
import sys


def main(out: str) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash import aot, ffi
    from jaxflash.kernels.variants.selftest import SelfTestConfig, scale_add, selftest_launch
    kd = os.path.join(out, "kernels")
    aot.build([selftest_launch(SelfTestConfig(d), "sm_90a")
               for d in ("float32", "bfloat16", "float16")], kd, progress=False)
    for dt, shape, a in ((jnp.float32, (33, 70), 1.5), (jnp.bfloat16, (5, 300), -0.75)):
        k1, k2 = jax.random.split(jax.random.key(42))
        x = jax.random.normal(k1, shape, jnp.float32).astype(dt)
        y = jax.random.normal(k2, shape, jnp.float32).astype(dt)
        exp = jax.export.export(
            jax.jit(lambda x, y, a: scale_add(x, y, a, arch="sm_90a")), platforms=["cuda"],
            disabled_checks=ffi.export_safety_checks())(x, y, a)
        name = f"scale_add_{jnp.dtype(dt).name}"
        with open(os.path.join(out, name + ".jaxexport"), "wb") as f:
            f.write(exp.serialize())
        expect = a * np.asarray(x, np.float32) + np.asarray(y, np.float32)
        # npz cannot hold bfloat16: store float32 (exact for these values) and the dtype name
        np.savez(os.path.join(out, name + ".npz"), x=np.asarray(x, np.float32),
                 y=np.asarray(y, np.float32), a=np.float32(a), expect=expect,
                 dtype=jnp.dtype(dt).name)
    print("wrote", sorted(os.listdir(out)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "artifacts/ffi_selftest")
