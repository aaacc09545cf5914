"""Scales between the caller's layouts (`jaxflash.quantize`) and the canonical one
(`jaxflash._types.AttentionArrays`: ``[B, heads, nblocks]`` float32), and the chain rule of
dequantization (the gradients an FP8 operand and its scale receive)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxflash import quantize as Q
from jaxflash.quantize import saturating_cast


def canonical_block(granularity: str, L: int, block_size: int) -> int:
    """Rows per block in the canonical layout: the whole sequence (at least 1) for per-tensor
    and per-head scales."""
    return block_size if granularity == "block" else max(int(L), 1)


def canonical_scale(scale, granularity: str, batch_shape: tuple, heads: int):
    """A scale in the caller's layout for an operand ``[*batch_shape, L, heads, D]`` ->
    ``[B, heads, nb]`` float32 (B the product of the batch dims; broadcast, never copied into
    a T-sized array)."""
    s = jnp.asarray(scale, jnp.float32)
    B = 1
    for d in batch_shape:   # (a symbolic dim under jax.export stays symbolic)
        B = B * d
    if granularity == "tensor":
        return jnp.broadcast_to(s.reshape(1, 1, 1), (B, heads, 1))
    if granularity == "head":
        return s.reshape(B, heads, 1)
    return s.reshape(B, heads, s.shape[-1])


def quantize_canonical(x, dtype, granularity: str, block: int):
    """Quantize a canonical operand ``[B, L, heads, D]``; returns ``(x8, scale [B, heads, nb])``
    with `block` the canonical block (see `canonical_block`)."""
    B, L, H = x.shape[0], x.shape[1], x.shape[2]
    g = "block" if granularity == "block" else granularity
    x8, s = Q.quantize(x, dtype, granularity=g, block_size=block)
    return x8, canonical_scale(s, g, (B,), H)


def row_scales(scale, block: int, L: int):
    """Canonical scale ``[B, heads, nb]`` -> ``[B, L, heads, 1]`` (row r reads block
    ``min(r // block, nb - 1)``)."""
    idx = jnp.minimum(jnp.arange(L) // block, scale.shape[-1] - 1)
    return jnp.swapaxes(jnp.take(scale, idx, axis=-1), 1, 2)[..., None]


def dequantize_canonical(x8, scale, block: int):
    """``x8 * scale`` in float32 for a canonical operand and its canonical scale."""
    return x8.astype(jnp.float32) * row_scales(scale, block, x8.shape[1])


def fp8_cotangents(x8, scale, block: int, dx):
    """The chain rule through ``x = x8 * scale`` for a gradient `dx` (float32, w.r.t. the
    dequantized operand): ``(dx8, dscale)`` with ``dx8 = dx * scale`` cast to x8's FP8 dtype
    (saturating; FP8 cotangents lose most of their precision: train through
    ``precision="fp8"`` on float inputs instead) and ``dscale = sum over its block of
    dx * x8`` (float32, exact up to float32 sums)."""
    L = x8.shape[1]
    dx = dx.astype(jnp.float32)
    dx8 = saturating_cast(dx * row_scales(scale, block, L), x8.dtype)
    contrib = jnp.swapaxes(jnp.sum(dx * x8.astype(jnp.float32), axis=-1), 1, 2)   # [B, h, L]
    nb = scale.shape[-1]
    pad = nb * block - L
    if pad >= 0:
        contrib = jnp.pad(contrib, ((0, 0), (0, 0), (0, pad)))
        dscale = contrib.reshape(contrib.shape[:2] + (nb, block)).sum(-1)
    else:  # one block longer than the canonical block count covers (rows clamp to the last)
        idx = jnp.minimum(jnp.arange(L) // block, nb - 1)
        dscale = jnp.zeros(scale.shape, jnp.float32).at[..., idx].add(contrib)
    return dx8, dscale
