"""jaxflash.fp4: FP4 (E2M1 / NVFP4 / MXFP4) formats and the emulated Blackwell Direct-P path.

* ``formats``   -- E2M1/E4M3/E5M2/E8M0 encode/decode, NVFP4/MXFP4 quantize/dequantize, packing.
* ``constants`` -- Direct-P constants shared with the sm_100a kernel (plain Python numbers).
* ``direct_p``  -- emulated Direct-P non-causal inference forward (``direct_p_attention``).
* ``training``  -- emulated FP4 training attention with its FP8 backward (custom_vjp).
* ``frontend``  -- ``fp4_attention`` (precision="fp4": kernel or ``emulate=True``) and
  ``explain_fp4``.
"""
from jaxflash.fp4 import constants
from jaxflash.fp4.direct_p import denominator_term, direct_p_attention, direct_p_probabilities
from jaxflash.fp4.frontend import explain_fp4, fp4_attention, has_sm100
from jaxflash.fp4.training import UnstableFP4Warning, do_flush_fraction, fp4_training_attention
from jaxflash.fp4.formats import (
    E2M1_BOUNDARIES, E2M1_MAX, E2M1_NAN_CODE, E2M1_VALUES, E4M3_MAX, E4M3_NAN_CODE, E5M2_MAX,
    E5M2_NAN_CODE, E8M0_BIAS, E8M0_NAN, MXFP4, MXFP4_BLOCK, NVFP4, NVFP4_BLOCK, e2m1_decode,
    e2m1_encode, e4m3_decode, e4m3_encode, e5m2_decode, e5m2_encode, e8m0_decode, e8m0_encode,
    fake_quant_fp8, fake_quant_mxfp4, fake_quant_nvfp4, mxfp4_dequantize, mxfp4_quantize,
    nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize, pack_e2m1, unpack_e2m1)

__all__ = [
    "constants", "denominator_term", "direct_p_attention", "direct_p_probabilities",
    "explain_fp4", "fp4_attention", "has_sm100", "UnstableFP4Warning", "do_flush_fraction",
    "fp4_training_attention", "E2M1_BOUNDARIES", "E2M1_MAX", "E2M1_NAN_CODE", "E2M1_VALUES", "E4M3_MAX",
    "E4M3_NAN_CODE", "E5M2_MAX", "E5M2_NAN_CODE", "E8M0_BIAS", "E8M0_NAN", "MXFP4",
    "MXFP4_BLOCK", "NVFP4", "NVFP4_BLOCK", "e2m1_decode", "e2m1_encode", "e4m3_decode",
    "e4m3_encode", "e5m2_decode", "e5m2_encode", "e8m0_decode", "e8m0_encode", "fake_quant_fp8",
    "fake_quant_mxfp4", "fake_quant_nvfp4", "mxfp4_dequantize", "mxfp4_quantize",
    "nvfp4_dequantize", "nvfp4_global_scale", "nvfp4_quantize", "pack_e2m1", "unpack_e2m1",
]
