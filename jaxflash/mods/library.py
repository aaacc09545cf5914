"""Ready-made mods, written as any user would write them: plain JAX on scalars.

Each factory returns a ``score_mod(score, b, h, q_idx, kv_idx, *aux)`` or
``mask_mod(b, h, q_idx, kv_idx, *aux)``. Those that read an array take ``slot``: which element
of the call's ``aux`` tuple is theirs, so mods compose (`and_masks`, `or_masks`, `chain`)
over one aux tuple. Python numbers given to a factory (a window size, a softcap) are part of
the mod's code: changing them gives another kernel; values that change during training or
between batches belong in ``aux``.

Semantics match the built-in arguments of `jaxflash.flash_attention` where one exists
(``is_causal``, ``local_window_size``, ``q_segment_ids`` / ``kv_segment_ids``, ``alibi_slopes``,
``softcap``): the same call with the mod gives the same result.

Those reading ``aux`` carry ``check_aux(aux, B, N, T, S)`` (`check_aux` below): a call checks
their arrays' shapes and dtypes as the built-ins check theirs (a mod's out-of-range reads
clamp, so a short table would otherwise give plausible wrong numbers); combinators check
their parts'.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def check_aux(mods, aux: tuple, B: int, N: int, T: int, S: int) -> None:
    """ValueError naming the shapes where an aux array does not fit what one of ``mods``
    (functions or None) reads; mods without a ``check_aux`` are not checked."""
    for m in mods:
        check = getattr(m, "check_aux", None)
        if check is not None:
            check(aux, B, N, T, S)


def _aux_rule(fn, slot: int, what: str, dims, kind: str):
    """Attach a check to `fn`: ``aux[slot]``'s dims are ``dims(B, N, T, S)``, each an int or a
    ``(text, allowed(dim) -> bool)`` pair, and its dtype kind ``kind`` ("f" floating, "i"
    integer)."""
    def check(aux, B, N, T, S):
        if slot >= len(aux):
            raise ValueError(f"{fn.__name__} reads aux[{slot}] ({what}); the call's aux has "
                             f"{len(aux)} element(s)")
        x = aux[slot]
        want = dims(B, N, T, S)
        got = tuple(getattr(x, "shape", np.shape(x)))
        ok = len(got) == len(want) and all(
            g == w if isinstance(w, int) else w[1](g) for g, w in zip(got, want))
        if not ok:
            spell = "(" + ", ".join(str(w) if isinstance(w, int) else w[0] for w in want) + (
                ",)" if len(want) == 1 else ")")
            raise ValueError(f"{fn.__name__}: aux[{slot}] must be {what}, shape {spell} with "
                             f"(B, N, T, S) = ({B}, {N}, {T}, {S}); got {got}")
        dt = jnp.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if not (jnp.issubdtype(dt, jnp.floating) if kind == "f"
                else jnp.issubdtype(dt, jnp.integer)):
            raise ValueError(f"{fn.__name__}: aux[{slot}] ({what}) must be "
                             f"{'floating' if kind == 'f' else 'integer'}; got {dt}")
    fn.check_aux = check
    return fn


def _one_or(n: int):
    return (f"1 or {n}", lambda g: g in (1, n))


def _with_parts(fn, parts):
    fn.check_aux = lambda aux, B, N, T, S: check_aux(parts, aux, B, N, T, S)
    return fn


def causal():
    """Key j visible to query i iff j <= i (top-left aligned, as ``is_causal=True``)."""
    def causal_mask(b, h, q_idx, kv_idx, *aux):
        return kv_idx <= q_idx
    return causal_mask


def sliding_window(left: int, right: int = 0):
    """``i - left <= j <= i + right`` (as ``local_window_size=(left, right)``)."""
    left, right = int(left), int(right)

    def sliding_window_mask(b, h, q_idx, kv_idx, *aux):
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)
    return sliding_window_mask


def chunked(chunk: int):
    """Local attention in fixed chunks: query i sees key j iff both are in the same chunk of
    ``chunk`` positions (combine with `causal` for chunked causal attention)."""
    chunk = int(chunk)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive; got {chunk}")

    def chunked_mask(b, h, q_idx, kv_idx, *aux):
        return q_idx // chunk == kv_idx // chunk
    return chunked_mask


def document(slot: int = 0):
    """Document (segment) masking for packed sequences: ``aux[slot]`` is ``doc_ids [B, L]``
    int32 with L >= max(T, S); query i sees key j iff ``doc_ids[b, i] == doc_ids[b, j]`` (as
    ``q_segment_ids = kv_segment_ids = doc_ids``)."""
    def document_mask(b, h, q_idx, kv_idx, *aux):
        ids = aux[slot]
        return ids[b, q_idx] == ids[b, kv_idx]
    # (a leading 1 is every batch row's ids)
    return _aux_rule(document_mask, slot, "doc_ids [B, L], L >= max(T, S)",
                     lambda B, N, T, S: (_one_or(B), (f">= {max(T, S)}",
                                                      lambda g: g >= max(T, S))), "i")


def prefix_lm(slot: int = 0):
    """Prefix-LM: bidirectional inside the prefix, causal after it. ``aux[slot]`` is
    ``prefix_len [B]`` int32; query i sees key j iff ``j <= i`` or ``j < prefix_len[b]``."""
    def prefix_lm_mask(b, h, q_idx, kv_idx, *aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[slot][b])
    return _aux_rule(prefix_lm_mask, slot, "prefix_len [B]", lambda B, N, T, S: (_one_or(B),),
                     "i")


def softcap(cap: float):
    """``cap * tanh(score / cap)`` (as ``softcap=cap``)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"softcap must be positive; got {cap}")

    def softcap_score(score, b, h, q_idx, kv_idx, *aux):
        return cap * jnp.tanh(score / cap)
    return softcap_score


def alibi(slot: int = 0):
    """ALiBi: ``score - slopes[h] * |i - j|``; ``aux[slot]`` is ``slopes [N]`` float32
    (learnable: its gradient is returned). As ``alibi_slopes=slopes``."""
    def alibi_score(score, b, h, q_idx, kv_idx, *aux):
        dist = jnp.abs(q_idx - kv_idx).astype(jnp.float32)
        return score - aux[slot][h] * dist
    return _aux_rule(alibi_score, slot, "slopes [N]", lambda B, N, T, S: (N,), "f")


def alibi_slopes(num_heads: int):
    """The ALiBi paper's slopes for `num_heads` heads (geometric, 2^(-8/n) ratio), float32."""
    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(num_heads).is_integer():
        s = pow2(num_heads)
    else:
        p = 2 ** math.floor(math.log2(num_heads))
        s = pow2(p) + pow2(2 * p)[0::2][:num_heads - p]
    return jnp.asarray(s, jnp.float32)


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's relative-position bucket of ``rel = kv_idx - q_idx`` (int32 scalar or array):
    exact buckets for small distances, logarithmic ones up to `max_distance`."""
    n = num_buckets
    ret = jnp.zeros_like(rel)
    if bidirectional:
        n //= 2
        ret = ret + jnp.where(rel > 0, n, 0).astype(rel.dtype)
        rel = jnp.abs(rel)
    else:
        rel = jnp.maximum(-rel, 0)
    exact = n // 2
    small = rel < exact
    relf = jnp.maximum(rel, 1).astype(jnp.float32)
    large = exact + (jnp.log(relf / exact) / math.log(max_distance / exact)
                     * (n - exact)).astype(rel.dtype)
    large = jnp.minimum(large, n - 1)
    return ret + jnp.where(small, rel, large)


def t5_bias(slot: int = 0, num_buckets: int = 32, max_distance: int = 128,
            bidirectional: bool = True):
    """T5 relative position bias: ``score + table[bucket(j - i), h]``; ``aux[slot]`` is
    ``table [num_buckets, N]`` float32 (learnable: its gradient is returned)."""
    def t5_score(score, b, h, q_idx, kv_idx, *aux):
        bucket = t5_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)
        return score + aux[slot][bucket, h]
    return _aux_rule(t5_score, slot, "table [num_buckets, N]",
                     lambda B, N, T, S: (num_buckets, N), "f")


def and_masks(*masks):
    """A mask_mod that keeps a pair iff every one of `masks` does."""
    def and_mask(b, h, q_idx, kv_idx, *aux):
        out = masks[0](b, h, q_idx, kv_idx, *aux)
        for m in masks[1:]:
            out = out & m(b, h, q_idx, kv_idx, *aux)
        return out
    return _with_parts(and_mask, masks)


def or_masks(*masks):
    """A mask_mod that keeps a pair iff any one of `masks` does."""
    def or_mask(b, h, q_idx, kv_idx, *aux):
        out = masks[0](b, h, q_idx, kv_idx, *aux)
        for m in masks[1:]:
            out = out | m(b, h, q_idx, kv_idx, *aux)
        return out
    return _with_parts(or_mask, masks)


def chain(*score_mods):
    """A score_mod applying `score_mods` in order (e.g. softcap, then ALiBi)."""
    def chained_score(score, b, h, q_idx, kv_idx, *aux):
        for f in score_mods:
            score = f(score, b, h, q_idx, kv_idx, *aux)
        return score
    return _with_parts(chained_score, score_mods)
