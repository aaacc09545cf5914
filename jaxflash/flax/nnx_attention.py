"""`FlashMultiHeadAttention` for Flax NNX.

Parameters are laid out like ``nnx.MultiHeadAttention``'s (``query``, ``key``, ``value``: ``
LinearGeneral`` to ``(heads, head_dim)``; ``out``: from ``(heads, head_dim)``; optional
``query_ln`` / ``key_ln``), so a state trained with one loads into the other. On top of it:
GQA (``num_kv_heads``), causal / local window / softcap / segment ids, rotary embeddings and a KV
cache for generation, all through `jaxflash.flash_attention` with the layer's ``implementation``.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Optional

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from jaxflash.flax import core


class FlashMultiHeadAttention(nnx.Module):
    """Multi-head (GQA / MQA) attention on jaxflash kernels.

    Args:
      num_heads: query heads N. in_features: input features.
      qkv_features: N * head_dim (default in_features). out_features: default in_features.
      num_kv_heads: key/value heads K (N a multiple of K; default N).
      in_kv_features: features of inputs_k / inputs_v (default in_features).
      is_causal, local_window_size, softcap, scale: the attention (see `jaxflash.flash_attention`).
      rope, rope_theta: rotary position embeddings on q and k.
      normalize_qk: LayerNorm (no bias) on q and k per head, as ``nnx.MultiHeadAttention``.
      decode: default for ``__call__``'s ``decode`` (incremental decoding with the KV cache).
      implementation: None (best available), "cute", "pallas", "xla".
      attention_precision: None or "fp8" (FP8 attention: `jaxflash.flash_attention`'s
        ``precision``).
      score_mod, mask_mod: custom attention (`jaxflash.mods`); the arrays they read (learnable
        ones too, e.g. an ``nnx.Param``'s value) come with each call as ``aux``. Not in decode.
      dtype, param_dtype, use_bias, kernel_init, out_kernel_init, bias_init, out_bias_init,
      kernel_metadata, out_kernel_metadata, bias_metadata, out_bias_metadata,
      query_ln_scale_metadata, key_ln_scale_metadata, precision (the projections'):
      as for ``nnx.MultiHeadAttention``
      (wrap an init with ``nnx.with_partitioning`` to shard parameters; meshes with Auto axes:
      the layer passes no ``out_sharding`` to its projections, which Explicit axes would need).

    No attention dropout here (the flash kernels have none): ``dropout_rate`` other than 0 is
    refused (``broadcast_dropout`` / ``deterministic`` are taken and change nothing); for it,
    use Flax's own module with `jaxflash.flax_layers.attention_fn`, which falls back visibly. With packed sequences
    (``segment_ids``) and rope, pass ``positions`` that restart at each segment.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: Optional[int] = None,
                 out_features: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 in_kv_features: Optional[int] = None, *, is_causal: bool = False,
                 local_window_size=None, softcap: Optional[float] = None,
                 scale: Optional[float] = None, rope: bool = False, rope_theta: float = 10000.0,
                 normalize_qk: bool = False, decode: bool = False,
                 implementation: Optional[str] = None, attention_precision: Optional[str] = None,
                 score_mod=None, mask_mod=None, dtype=None, param_dtype=jnp.float32,
                 use_bias: bool = True, kernel_init=default_kernel_init, out_kernel_init=None,
                 bias_init=initializers.zeros_init(), out_bias_init=None,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}),
                 out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
                 query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
                 key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
                 precision=None, dropout_rate: float = 0.0, broadcast_dropout: bool = True,
                 deterministic: Optional[bool] = None, rngs: nnx.Rngs):
        if dropout_rate:
            raise NotImplementedError(
                f"dropout_rate={dropout_rate}: the flash kernels have no attention dropout; use "
                f"nnx.MultiHeadAttention with attention_fn=jaxflash.flax_layers.attention_fn, "
                f"which falls back to the explicit-weights path for it")
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features or in_features
        self.out_features = out_features or in_features
        self.in_kv_features = in_kv_features or in_features
        self.num_kv_heads, self.head_dim = core.check_heads(num_heads, num_kv_heads,
                                                            self.qkv_features)
        self.opts = core.AttentionOptions.make(
            is_causal=is_causal, local_window_size=local_window_size, softcap=softcap,
            scale=scale, rope=rope, rope_theta=rope_theta, implementation=implementation,
            attention_precision=attention_precision, score_mod=score_mod, mask_mod=mask_mod)
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim; got {self.head_dim}")
        self.normalize_qk = normalize_qk
        self.decode = decode
        self.dtype = dtype

        def linear(in_f, out_f, axis=-1, k_init=kernel_init, b_init=bias_init,
                   k_meta=kernel_metadata, b_meta=bias_metadata):
            return nnx.LinearGeneral(in_f, out_f, axis=axis, use_bias=use_bias, dtype=dtype,
                                     param_dtype=param_dtype, kernel_init=k_init,
                                     bias_init=b_init, precision=precision,
                                     kernel_metadata=k_meta, bias_metadata=b_meta, rngs=rngs)

        self.query = linear(in_features, (num_heads, self.head_dim))
        self.key = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.value = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        if normalize_qk:
            self.query_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                          param_dtype=param_dtype, rngs=rngs,
                                          scale_metadata=query_ln_scale_metadata)
            self.key_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                        param_dtype=param_dtype, rngs=rngs,
                                        scale_metadata=key_ln_scale_metadata)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = linear((num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                          k_init=out_kernel_init or kernel_init,
                          b_init=out_bias_init or bias_init,
                          k_meta=out_kernel_metadata or kernel_metadata,
                          b_meta=out_bias_metadata or bias_metadata)
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)

    @property
    def implementation(self):
        """The jaxflash backend the layer asks for (None = best available); assignable."""
        return self.opts.implementation

    @implementation.setter
    def implementation(self, value):
        self.opts = dataclasses.replace(self.opts, implementation=core.AttentionOptions.make(
            implementation=value).implementation)

    def init_cache(self, input_shape, dtype=None):
        """Allocate the KV cache for ``input_shape = (batch..., max_length, features)`` (the
        shape of the longest sequence to generate, as for ``nnx.MultiHeadAttention``)."""
        shape = tuple(input_shape[:-1]) + (self.num_kv_heads, self.head_dim)
        dt = dtype or self.dtype or jnp.float32
        self.cached_key = nnx.Cache(jnp.zeros(shape, dt))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dt))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, segment_ids=None,
                 kv_segment_ids=None, positions=None, kv_positions=None,
                 decode: Optional[bool] = None, aux=None, is_causal: bool = False,
                 deterministic: Optional[bool] = None, rngs=None, sow_weights: bool = False):
        """inputs ``[batch..., length, features]`` -> ``[batch..., length, out_features]``.

        mask: ``[batch..., heads or 1, q_len, kv_len]`` (True/nonzero = attend).
        segment_ids: ``[batch..., q_len]`` int32 (packed sequences; ``kv_segment_ids`` defaults
          to it for self-attention). positions / kv_positions: ``[batch..., len]`` int for rope
          (default 0, 1, ...; in decode, the cache index onward).
        decode: feed the next ``t >= 1`` tokens, attending to everything cached so far (call
          `init_cache` first). Self-attention only.
        aux: the arrays the layer's score_mod / mask_mod read (`jaxflash.flash_attention`).
        is_causal: causal for this call too (as ``nnx.MultiHeadAttention``'s call argument).
        deterministic / rngs: taken for ``nnx.MultiHeadAttention``'s call signature; this layer
          has no attention dropout, so they change nothing. sow_weights=True is refused: the
          kernels form no weights (Flax's layer with `jaxflash.flax_layers.attention_fn` sows).
        """
        if sow_weights:
            raise NotImplementedError(
                "sow_weights: the kernels never form the attention weights; use "
                "nnx.MultiHeadAttention with attention_fn=jaxflash.flax_layers.attention_fn, "
                "which sows them on its explicit-weights path")
        opts = self.opts
        if is_causal and not opts.is_causal:
            opts = dataclasses.replace(opts, is_causal=True)
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k cannot be None when inputs_v is given")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features; the layer expects "
                             f"{self.in_features} (inputs_q shape {inputs_q.shape})")
        decode = self.decode if decode is None else decode
        q = self.query(inputs_q)
        k = self.key(inputs_k)
        v = self.value(inputs_v)
        if self.normalize_qk:
            q = self.query_ln(q)
            k = self.key_ln(k)
        batch = q.shape[:-3]
        T = q.shape[-3]

        if decode:
            if self.cache_index is None:
                raise ValueError("decode=True needs the KV cache: call init_cache first")
            if inputs_k is not inputs_q or segment_ids is not None:
                raise ValueError("decode supports self-attention without segment ids only")
            index = self.cache_index[...]
            if opts.rope:
                pos = core.default_positions(batch, T, index) if positions is None else positions
                q = core.apply_rope(q, pos, opts.rope_theta)
                k = core.apply_rope(k, pos, opts.rope_theta)
            ck, cv = core.update_cache(self.cached_key[...], self.cached_value[...], index, k, v)
            self.cached_key[...] = ck
            self.cached_value[...] = cv
            self.cache_index[...] = index + T
            x = core.attend_cached(q, ck.astype(q.dtype), cv.astype(q.dtype), index, opts,
                                   mask=mask)
            return self.out(x)

        x = core.attend_sequence(q, k, v, opts, self_attn=inputs_k is inputs_q, mask=mask,
                                 positions=positions, kv_positions=kv_positions,
                                 segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                 aux=aux)
        return self.out(x)
