"""Custom attention in plain JAX: ``score_mod``, ``mask_mod``, their ``aux`` arrays and block
sparsity.

- `spec`: `ModSpec`, the normalized hashable description every backend receives, and the
  mods' jaxprs on scalars (`score_jaxpr`, `score_deriv_jaxpr`, `mask_jaxpr`) that kernel code
  generators translate; its ``key`` follows the code, never the aux values.
- `library`: ready-made mods (causal, sliding window, chunked, document, prefix-LM, ALiBi,
  softcap, T5 bias) and their combinators.
- `block_mask`: `create_block_mask` and `BlockMask`.
- `dense`: the mods on index grids (reference, block masks, aux gradients).
- `aux_grad`: gradients of the aux arrays for backends whose kernels give dQ / dK / dV only.
"""
from jaxflash.mods.block_mask import BlockMask, create_block_mask
from jaxflash.mods.library import (alibi, alibi_slopes, and_masks, causal, chain, chunked,
                                   document, or_masks, prefix_lm, sliding_window, softcap,
                                   t5_bias, t5_bucket)
from jaxflash.mods.spec import (ModSpec, make_spec, mask_jaxpr, normalize_aux, score_deriv_jaxpr,
                                score_jaxpr)

__all__ = [
    "BlockMask", "ModSpec", "alibi", "alibi_slopes", "and_masks", "causal", "chain", "chunked",
    "create_block_mask", "document", "make_spec", "mask_jaxpr", "normalize_aux", "or_masks",
    "prefix_lm", "score_deriv_jaxpr", "score_jaxpr", "sliding_window", "softcap", "t5_bias",
    "t5_bucket",
]
