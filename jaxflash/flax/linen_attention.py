"""`FlashMultiHeadAttention` for Flax Linen.

Parameter tree as ``linen.MultiHeadDotProductAttention``'s (``query``, ``key``, ``value``,
``out`` DenseGeneral; ``query_ln`` / ``key_ln`` with normalize_qk), so parameters are
interchangeable when ``num_kv_heads`` equals ``num_heads``. Decoding follows Linen's convention:
``init`` with ``decode=True`` on a ``[batch..., max_length, features]`` input creates the
``'cache'`` collection; later calls with ``mutable=['cache']`` feed the next tokens.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax.numpy as jnp
from flax import linen as nn

from jaxflash.flax import core


class FlashMultiHeadAttention(nn.Module):
    """Multi-head (GQA / MQA) attention on jaxflash kernels; arguments as the NNX layer's."""

    num_heads: int
    qkv_features: Optional[int] = None
    out_features: Optional[int] = None
    num_kv_heads: Optional[int] = None
    is_causal: bool = False
    local_window_size: Any = None
    softcap: Optional[float] = None
    scale: Optional[float] = None
    rope: bool = False
    rope_theta: float = 10000.0
    normalize_qk: bool = False
    decode: bool = False
    implementation: Optional[str] = None
    attention_precision: Optional[str] = None  # None or "fp8" (flash_attention's precision)
    score_mod: Optional[Callable] = None        # custom attention (jaxflash.mods); the arrays
    mask_mod: Optional[Callable] = None         # they read come with each call as ``aux``
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    kernel_init: Callable = nn.linear.default_kernel_init
    out_kernel_init: Optional[Callable] = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Optional[Callable] = None
    precision: Any = None           # the projections' (linen.MultiHeadDotProductAttention's)
    # Taken for linen.MultiHeadDotProductAttention's fields; no attention dropout here (the
    # kernels have none): a dropout_rate other than 0 is refused.
    dropout_rate: float = 0.0
    broadcast_dropout: bool = True
    deterministic: Optional[bool] = None

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, segment_ids=None,
                 kv_segment_ids=None, positions=None, kv_positions=None, aux=None):
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k cannot be None when inputs_v is given")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        self_attn = inputs_k is inputs_q
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        out_features = self.out_features or inputs_q.shape[-1]
        num_kv_heads, head_dim = core.check_heads(self.num_heads, self.num_kv_heads,
                                                  qkv_features)
        opts = core.AttentionOptions.make(
            is_causal=self.is_causal, local_window_size=self.local_window_size,
            softcap=self.softcap, scale=self.scale, rope=self.rope, rope_theta=self.rope_theta,
            implementation=self.implementation, attention_precision=self.attention_precision,
            score_mod=self.score_mod, mask_mod=self.mask_mod)

        if self.dropout_rate:
            raise NotImplementedError(
                f"dropout_rate={self.dropout_rate}: the flash kernels have no attention "
                f"dropout; use linen.MultiHeadDotProductAttention with "
                f"attention_fn=jaxflash.flax_layers.attention_fn, which falls back for it")

        def dense(heads, name):
            return nn.DenseGeneral(features=(heads, head_dim), axis=-1, dtype=self.dtype,
                                   param_dtype=self.param_dtype, use_bias=self.use_bias,
                                   kernel_init=self.kernel_init, bias_init=self.bias_init,
                                   precision=self.precision, name=name)

        q = dense(self.num_heads, "query")(inputs_q)
        k = dense(num_kv_heads, "key")(inputs_k)
        v = dense(num_kv_heads, "value")(inputs_v)
        if self.normalize_qk:
            q = nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                             name="query_ln")(q)
            k = nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                             name="key_ln")(k)
        batch = q.shape[:-3]
        T = q.shape[-3]

        initialized = self.has_variable("cache", "cached_key")
        if self.decode and initialized:
            if not self_attn or segment_ids is not None:
                raise ValueError("decode supports self-attention without segment ids only")
            ck = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            ci = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            index = ci.value
            if opts.rope:
                pos = core.default_positions(batch, T, index) if positions is None else positions
                q = core.apply_rope(q, pos, opts.rope_theta)
                k = core.apply_rope(k, pos, opts.rope_theta)
            ck.value, cv.value = core.update_cache(ck.value, cv.value, index, k, v)
            ci.value = index + T
            x = core.attend_cached(q, ck.value.astype(q.dtype), cv.value.astype(q.dtype),
                                   index, opts, mask=mask)
        else:
            if self.decode:  # first (init) call: the cache takes this input's length
                self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
                self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
                self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            x = core.attend_sequence(q, k, v, opts, self_attn=self_attn, mask=mask,
                                     positions=positions, kv_positions=kv_positions,
                                     segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                     aux=aux)
        return nn.DenseGeneral(features=out_features, axis=(-2, -1), dtype=self.dtype,
                               param_dtype=self.param_dtype, use_bias=self.use_bias,
                               kernel_init=self.out_kernel_init or self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init,
                               precision=self.precision, name="out")(x)
