"""Flax layers on jaxflash (the public import path; the code lives in `jaxflash.flax`).

- `attention_fn` / `make_attention_fn`: drop-ins for the ``attention_fn`` hook of
  ``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention``. Calls needing
  what the flash path cannot do (attention dropout, sowing weights, custom einsums) take an
  explicit-weights path; `last_fallback_reason` (a live module attribute) and `fallback_counts`
  record it, and the ``jaxflash.flax`` logger warns once per reason.
- `FlashMultiHeadAttention` (NNX) and `LinenFlashMultiHeadAttention`: q/k/v/out projections, GQA,
  causal / window / softcap / segment ids, rotary embeddings, KV-cache decoding.
- `apply_rope`: the rotary embedding the layers use.
"""
from jaxflash.flax import attention_fn as _attn
from jaxflash.flax.attention_fn import (attention_fn, fallback_counts, make_attention_fn,
                                        reset_fallback_record)
from jaxflash.flax.core import AttentionOptions, apply_rope
from jaxflash.flax.linen_attention import FlashMultiHeadAttention as LinenFlashMultiHeadAttention
from jaxflash.flax.nnx_attention import FlashMultiHeadAttention

__all__ = ["attention_fn", "make_attention_fn", "FlashMultiHeadAttention",
           "LinenFlashMultiHeadAttention", "AttentionOptions", "apply_rope",
           "last_fallback_reason", "fallback_counts", "reset_fallback_record"]


def __getattr__(name):
    # A live attribute: the reason the latest attention_fn call (at trace time) fell back, or None.
    if name == "last_fallback_reason":
        return _attn.last_fallback_reason()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
