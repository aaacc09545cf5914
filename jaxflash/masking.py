"""The one definition of which (query, key) pairs may attend, and of the logit transforms.

Written on broadcastable index arrays so the same functions serve the full-matrix reference
(indices ``[T, 1]`` and ``[1, S]``) and a Pallas tile (indices of one block). The CuTe DSL kernels
implement the same predicates in device code; their tests compare against this module through
the reference.

Semantics follow ``jax.nn.dot_product_attention``:
- causal: key j visible to query i iff ``j <= i`` (top-left aligned, also when T != S);
- window ``(left, right)``: ``i - left <= j <= i + right``;
- seq lengths: ``i < q_seqlen[b]`` and ``j < kv_seqlen[b]``;
- segment ids (our addition): ``q_seg[b, i] == kv_seg[b, j]``.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp


def keep(q_idx, k_idx, *, is_causal: bool, window: Optional[tuple[int, int]],
         q_seqlen=None, kv_seqlen=None, q_seg=None, kv_seg=None):
    """Boolean "may attend" for broadcastable query/key index arrays.

    ``q_seqlen``/``kv_seqlen`` are scalars or arrays broadcastable against the indices (the
    caller picks the batch row); ``q_seg``/``kv_seg`` are the segment ids at ``q_idx``/``k_idx``,
    already gathered and shaped to broadcast like them. Returns None when nothing is masked, so
    callers can skip the select entirely.
    """
    conds = []
    if is_causal:
        conds.append(k_idx <= q_idx)
    if window is not None:
        left, right = window
        conds.append(k_idx >= q_idx - left)
        conds.append(k_idx <= q_idx + right)
    if q_seqlen is not None:
        conds.append(q_idx < q_seqlen)
    if kv_seqlen is not None:
        conds.append(k_idx < kv_seqlen)
    if q_seg is not None:
        conds.append(q_seg == kv_seg)
    if not conds:
        return None
    out = conds[0]
    for c in conds[1:]:
        out = jnp.logical_and(out, c)
    return out


def transform_logits(s, q_idx, k_idx, *, scale: float, softcap: Optional[float],
                     alibi_slope=None, bias=None):
    """Raw scores ``q.k`` (float32) -> logits, in the documented order.

    Order: scale, softcap (``softcap * tanh(x / softcap)``), ALiBi (``-slope * |i - j|``), bias.
    Masks are applied afterwards by the caller with `keep`.
    """
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if alibi_slope is not None:
        s = s - alibi_slope * jnp.abs(q_idx - k_idx).astype(s.dtype)
    if bias is not None:
        s = s + bias.astype(s.dtype)
    return s


def block_may_attend(q_lo, q_hi, k_lo, k_hi, *, is_causal: bool,
                     window: Optional[tuple[int, int]]):
    """Whether a tile [q_lo, q_hi) x [k_lo, k_hi) can hold any visible pair under the static
    masks (causal, window). Tiles for which this is False are skipped entirely. Works on Python
    ints and on traced scalars alike."""
    ok = True
    if is_causal:
        ok = jnp.logical_and(ok, k_lo <= q_hi - 1)
    if window is not None:
        left, right = window
        ok = jnp.logical_and(ok, k_hi - 1 >= q_lo - left)
        ok = jnp.logical_and(ok, k_lo <= q_hi - 1 + right)
    return ok


def block_fully_visible(q_lo, q_hi, k_lo, k_hi, *, is_causal: bool,
                        window: Optional[tuple[int, int]]):
    """Whether every pair of the tile passes the static masks (so the per-element select can be
    skipped). Dynamic masks (seq lengths, segments, dense mask) are not considered."""
    ok = True
    if is_causal:
        ok = jnp.logical_and(ok, k_hi - 1 <= q_lo)
    if window is not None:
        left, right = window
        ok = jnp.logical_and(ok, k_lo >= q_hi - 1 - left)
        ok = jnp.logical_and(ok, k_hi - 1 <= q_lo + right)
    return ok
