"""jaxflash.fp8: FP8 attention's numerics.

* ``contract`` -- the numerics contract (constants and the exact recipe) the FP8 kernels match.
* ``emulated`` -- that contract in plain JAX: the FP8 path on any device (dispatch's fallback).

Quantization and the Hadamard transform are `jaxflash.quantize`; the API is
`jaxflash.flash_attention` (FP8 inputs with ``q_scale`` / ``k_scale`` / ``v_scale``, or
``precision="fp8"``).
"""
from jaxflash.fp8 import contract

__all__ = ["contract"]
