"""What the NNX and Linen layers share: validated options, rotary embeddings, the KV-cache update
and the attention call (training and incremental decoding) through `jaxflash.flash_attention`.

Kept free of Flax imports so both layer modules can use it and it can be tested on plain arrays.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxflash import dispatch
from jaxflash.api import flash_attention


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The attention (not projection) settings of a FlashMultiHeadAttention layer.

    ``local_window_size``: int w (= (w, w)) or (left, right); ``rope``: rotate q and k by their
    positions (GPT-NeoX half-split layout) with wavelength base ``rope_theta``; ``scale``: None
    means 1/sqrt(head_dim); ``implementation``: None (best available), "cute", "pallas", "xla";
    ``attention_precision``: None or "fp8" (`jaxflash.flash_attention`'s ``precision``: named
    apart from Flax's ``precision``, the einsums' `jax.lax.Precision`); ``score_mod`` /
    ``mask_mod``: custom attention (`jaxflash.mods`; the arrays they read come with each call
    as ``aux``).
    """

    is_causal: bool = False
    local_window_size: Optional[tuple[int, int]] = None
    softcap: Optional[float] = None
    scale: Optional[float] = None
    rope: bool = False
    rope_theta: float = 10000.0
    implementation: Optional[str] = None
    attention_precision: Optional[str] = None
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None

    @classmethod
    def make(cls, *, is_causal=False, local_window_size=None, softcap=None, scale=None,
             rope=False, rope_theta=10000.0, implementation=None,
             attention_precision=None, score_mod=None, mask_mod=None) -> "AttentionOptions":
        w = local_window_size
        if w is not None:
            if isinstance(w, numbers.Integral) and not isinstance(w, bool):
                w = (int(w), int(w))
            elif isinstance(w, (tuple, list)) and len(w) == 2:
                w = (int(w[0]), int(w[1]))
            else:
                raise ValueError(f"local_window_size must be an int or a (left, right) pair; "
                                 f"got {local_window_size!r}")
        if implementation is not None and implementation not in dispatch.IMPLEMENTATIONS:
            raise ValueError(f"implementation must be None or one of {dispatch.IMPLEMENTATIONS}; "
                             f"got {implementation!r}")
        if attention_precision not in (None, "fp8"):
            raise ValueError(f"attention_precision must be None or 'fp8'; got "
                             f"{attention_precision!r}")
        for name, f in (("score_mod", score_mod), ("mask_mod", mask_mod)):
            if f is not None and not callable(f):
                raise ValueError(f"{name} must be a function; got {f!r}")
        if rope and not rope_theta > 0:
            raise ValueError(f"rope_theta must be positive; got {rope_theta!r}")
        return cls(is_causal=bool(is_causal), local_window_size=w,
                   softcap=None if softcap is None else float(softcap),
                   scale=None if scale is None else float(scale), rope=bool(rope),
                   rope_theta=float(rope_theta), implementation=implementation,
                   attention_precision=attention_precision, score_mod=score_mod,
                   mask_mod=mask_mod)

    @property
    def mods(self) -> dict:
        """The flash_attention keywords of the layer's mods (empty without them)."""
        return {k: f for k, f in (("score_mod", self.score_mod), ("mask_mod", self.mask_mod))
                if f is not None}


def check_heads(num_heads: int, num_kv_heads: Optional[int], qkv_features: int):
    """(num_kv_heads, head_dim) after checking the head arithmetic."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if qkv_features % num_heads:
        raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                         f"({num_heads})")
    return num_kv_heads, qkv_features // num_heads


def apply_rope(x, positions, theta: float = 10000.0):
    """Rotary position embedding of ``x [B..., T, N, H]`` at integer ``positions [B..., T]``.

    Half-split layout (GPT-NeoX / Llama in most JAX code): feature ``d < H/2`` is paired with
    ``d + H/2`` and rotated by ``positions * theta**(-2d/H)``. Computed in float32, returned in
    x's dtype. Scores q.k of rotated vectors depend only on the position difference.
    """
    H = x.shape[-1]
    if H % 2:
        raise ValueError(f"rotary embeddings need an even head dim; got x shape {x.shape}")
    if positions.shape != x.shape[:-2]:
        raise ValueError(f"positions must have shape [B..., T] = {x.shape[:-2]}; got "
                         f"{positions.shape}")
    half = H // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq        # [B..., T, H/2]
    sin, cos = jnp.sin(ang)[..., None, :], jnp.cos(ang)[..., None, :]  # [B..., T, 1, H/2]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def default_positions(batch_shape, length: int, start=0):
    """``start + arange(length)`` broadcast to ``batch_shape + (length,)`` (int32)."""
    pos = jnp.asarray(start, jnp.int32) + jnp.arange(length, dtype=jnp.int32)
    return jnp.broadcast_to(pos, tuple(batch_shape) + (length,))


def _as_bool_mask(mask):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    # Flax builds masks as float 0/1 (make_attention_mask, combine_masks); nonzero = attend.
    return mask if mask.dtype == jnp.bool_ else mask != 0


def attend(q, k, v, opts: AttentionOptions, *, mask=None, q_segment_ids=None,
           kv_segment_ids=None, aux=None):
    """Training / full-sequence attention on projected heads (q [B..., T, N, H])."""
    if aux is not None and not opts.mods:
        raise ValueError("aux given to a layer without score_mod / mask_mod")
    return flash_attention(
        q, k, v, mask=_as_bool_mask(mask), scale=opts.scale, is_causal=opts.is_causal,
        local_window_size=opts.local_window_size, softcap=opts.softcap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        implementation=opts.implementation, precision=opts.attention_precision,
        **opts.mods, **({} if aux is None else {"aux": aux}))


def attend_sequence(q, k, v, opts: AttentionOptions, *, self_attn: bool, mask=None,
                    positions=None, kv_positions=None, segment_ids=None, kv_segment_ids=None,
                    aux=None):
    """What both layers (NNX, Linen) do outside decoding: rotary embeddings when enabled (self-
    attention keys default to the query positions), segment-id defaults, then `attend`."""
    batch = q.shape[:-3]
    T, S = q.shape[-3], k.shape[-3]
    if opts.rope:
        if positions is not None and kv_positions is None and not self_attn:
            # keys from a separate array: self-attention on a copy, or cross-attention whose
            # keys have positions of their own; guessing either would be silently wrong
            raise ValueError(f"rope: positions given for the queries {tuple(q.shape)} but no "
                             f"kv_positions for keys of a separate inputs_k {tuple(k.shape)}: "
                             f"pass kv_positions (for self-attention, inputs_k=None)")
        pos = default_positions(batch, T) if positions is None else positions
        if kv_positions is None:
            kv_positions = pos if self_attn else default_positions(batch, S)
        q = apply_rope(q, pos, opts.rope_theta)
        k = apply_rope(k, kv_positions, opts.rope_theta)
    if segment_ids is not None and kv_segment_ids is None:
        if T != S:
            raise ValueError(f"segment_ids given for q_len {T} != kv_len {S}: pass "
                             f"kv_segment_ids too")
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids")
    return attend(q, k, v, opts, mask=mask, q_segment_ids=segment_ids,
                  kv_segment_ids=kv_segment_ids, aux=aux)


def update_cache(cached_key, cached_value, index, k, v):
    """Write the new ``k, v [B..., t, K, H]`` at ``index`` of the caches ``[B..., L, K, H]``.

    Returns the updated caches. index + t must stay <= L: a concrete index past it raises
    ValueError; under jit (a traced index) the keys written are NaN, so the outputs are too,
    never a silently clamped write over older keys.
    """
    if k.shape[:-3] != cached_key.shape[:-3] or k.shape[-2:] != cached_key.shape[-2:]:
        raise ValueError(f"decode: new keys {k.shape} do not fit the cache {cached_key.shape} "
                         f"(expected [B..., t, K, H] with B..., K, H of the cache)")
    if k.shape[-3] > cached_key.shape[-3]:
        raise ValueError(f"decode: {k.shape[-3]} new tokens exceed the cache length "
                         f"{cached_key.shape[-3]}")
    t, L = k.shape[-3], cached_key.shape[-3]
    if not isinstance(index, jax.core.Tracer):
        end = int(jnp.max(jnp.asarray(index))) + t
        if end > L:
            raise ValueError(f"decode: {t} new tokens at cache index {end - t} pass the cache "
                             f"length {L} (init_cache with a longer max length)")
    else:
        k = jnp.where(jnp.asarray(index, jnp.int32) + t <= L, k, jnp.nan).astype(k.dtype)
    nb = k.ndim - 3
    zero = jnp.zeros((), jnp.int32)
    idx = (zero,) * nb + (jnp.asarray(index, jnp.int32), zero, zero)
    ck = jax.lax.dynamic_update_slice(cached_key, k.astype(cached_key.dtype), idx)
    cv = jax.lax.dynamic_update_slice(cached_value, v.astype(cached_value.dtype), idx)
    return ck, cv


def attend_cached(q, cached_key, cached_value, index, opts: AttentionOptions, *, mask=None):
    """Attention of ``t`` new queries (``q [B..., t, N, H]``, at positions index .. index+t-1)
    over a cache ``[B..., L, K, H]`` that already holds the keys up to position index+t-1.

    Cache slots past the written ones never count. With ``is_causal`` the new query at position
    p sees keys j <= p, so step-by-step (or chunked) decoding equals the full causal forward;
    without it, it sees every written key. The window is applied on absolute positions.
    """
    if opts.mods:
        # a mod sees a call's own query indices, 0.. t-1 here, not the cache positions
        raise NotImplementedError("score_mod / mask_mod in incremental decoding: the mods see "
                                  "the call's query indices, not the cached positions")
    nb = q.ndim - 3
    t, L = q.shape[-3], cached_key.shape[-3]
    index = jnp.asarray(index, jnp.int32)
    user_mask = _as_bool_mask(mask)
    written = index + t
    common = dict(scale=opts.scale, softcap=opts.softcap, implementation=opts.implementation,
                  precision=opts.attention_precision)
    if t == 1 and opts.local_window_size is None and user_mask is None:
        # One new token: "key written" is exactly "key visible" (causal or not), and a
        # kv_seq_lengths operand keeps the backends on their mask-free fast path.
        lengths = jnp.full(q.shape[:nb] if nb else (1,), written, jnp.int32)
        return flash_attention(q, cached_key, cached_value,
                                        key_value_seq_lengths=lengths, **common)
    pos = index + jnp.arange(t, dtype=jnp.int32)[:, None]        # [t, 1] absolute positions
    j = jnp.arange(L, dtype=jnp.int32)[None, :]                   # [1, L]
    keep = j < written
    if opts.is_causal:
        keep = keep & (j <= pos)
    if opts.local_window_size is not None:
        left, right = opts.local_window_size
        keep = keep & (j >= pos - left) & (j <= pos + right)
    keep = jnp.broadcast_to(keep, (t, L)).reshape((1,) * (nb + 1) + (t, L))
    if user_mask is not None:
        keep = jnp.logical_and(keep, user_mask)
    return flash_attention(q, cached_key, cached_value, mask=keep, **common)
