"""jaxflash: FlashAttention for JAX.

`flash_attention` is a drop-in for `jax.nn.dot_product_attention` with more features (softcap,
ALiBi, segment ids, GQA with any value head dim) and faster backends; `explain` says which
backend a call would use and why. `quantize` makes FP8 tensors and their scales.
"""
from jaxflash import mods
from jaxflash import quantize
from jaxflash.api import explain, flash_attention
from jaxflash.mods import BlockMask, create_block_mask
from jaxflash.dispatch import target_platform
from jaxflash.ring import ring_attention

__version__ = "0.1.0"
__all__ = ["flash_attention", "explain", "ring_attention", "target_platform", "flax_layers",
           "mods", "quantize", "create_block_mask", "BlockMask", "__version__"]


def __getattr__(name):
    # Flax is an optional dependency: its layers load on first use of `jaxflash.flax_layers`.
    if name == "flax_layers":
        import importlib
        return importlib.import_module("jaxflash.flax_layers")
    raise AttributeError(f"module 'jaxflash' has no attribute {name!r}")
