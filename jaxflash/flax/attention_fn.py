"""`attention_fn`: a drop-in for the ``attention_fn`` hook of ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention``.

Both hooks call ``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=..., ...)`` with
query ``[batch..., q_len, heads, head_dim]`` (our layout) and masks ``[batch..., heads, q, kv]``
(bool, or float 0/1 as Flax's mask helpers make them). Linen passes only the keywords named in the
function's signature, so every keyword is spelled out here.

The fast path is `jaxflash.flash_attention`. Three things it cannot do; each one sends the call to
a weights path (explicit T x S attention weights, the jaxflash reference semantics) that does
them, and each is recorded (`last_fallback_reason`, `fallback_counts`) and logged once as a
warning on the ``jaxflash.flax`` logger:

- attention dropout (``dropout_rate > 0`` and not ``deterministic``), drawn exactly like Flax's
  ``dot_product_attention_weights`` (same key, same shape -> the same keep mask);
- sowing the attention weights (``module`` given: NNX ``nnx.Intermediate`` / Linen
  ``'intermediates'``, name ``attention_weights``);
- custom einsums (``einsum_dot_general``, ``qk_attn_weights_einsum``,
  ``attn_weights_value_einsum``, e.g. AQT quantization), and dtypes the kernels do not take.

Honoured without leaving the fast path: ``dtype`` / ``promote_dtype`` (inputs promoted the Flax
way), ``force_fp32_for_softmax`` (softmax statistics are always float32), ``precision`` (the fast
path always accumulates in float32, at least what any precision asks; the weights path passes it
to its einsums), ``is_causal``, ``bias``, ``mask``.

One difference from Flax: a query row whose keys are all masked gives 0 (jaxflash semantics),
where Flax gives the average of the values.
"""
from __future__ import annotations

import collections
import functools
import inspect
import logging
from typing import Optional

import jax
import jax.numpy as jnp

from jaxflash import masking, reference
from jaxflash.api import _prepare, flash_attention

logger = logging.getLogger("jaxflash.flax")

_FAST_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                jnp.dtype(jnp.float64))   # float64: x64 only, the XLA reference

# The record of fallbacks, read through jaxflash.flax_layers.last_fallback_reason (None = the last
# call took the fast path) and fallback_counts (reason -> number of traced calls).
_state = {"last_fallback_reason": None}
fallback_counts: collections.Counter = collections.Counter()
_warned: set = set()


def last_fallback_reason() -> Optional[str]:
    """Why the most recent `attention_fn` call (at trace time) left the fast path, or None."""
    return _state["last_fallback_reason"]


def reset_fallback_record():
    """Forget recorded fallbacks and warnings (for tests)."""
    _state["last_fallback_reason"] = None
    fallback_counts.clear()
    _warned.clear()


def _record(reason: Optional[str]):
    _state["last_fallback_reason"] = reason
    if reason is None:
        return
    fallback_counts[reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("jaxflash attention_fn: %s; using the explicit attention-weights path "
                       "(materializes [batch, heads, q_len, kv_len]) instead of the flash path",
                       reason)


def _promote(query, key, value, dtype, promote_dtype):
    if promote_dtype is not None:
        return tuple(promote_dtype((query, key, value), dtype=dtype))
    dt = dtype if dtype is not None else jnp.result_type(query, key, value)
    return tuple(jnp.asarray(x, dt) for x in (query, key, value))


def _static_bool(x):
    """bool(x) for Python/NumPy values; None for a traced value (decided at run time)."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, promote_dtype=None, is_causal: bool = False,
                 force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                 implementation: Optional[str] = None, scale: Optional[float] = None,
                 softcap: Optional[float] = None, local_window_size=None,
                 attention_precision: Optional[str] = None, score_mod=None, mask_mod=None,
                 aux=None, **unknown):
    """Flax-compatible attention on jaxflash. See the module docstring for what each keyword does.

    Extra (jaxflash) keywords: ``implementation``, ``scale``, ``softcap``, ``local_window_size``,
    ``attention_precision`` (None or "fp8": `jaxflash.flash_attention`'s ``precision``, named
    apart from Flax's ``precision``, the einsums' `jax.lax.Precision`), ``score_mod`` /
    ``mask_mod`` / ``aux`` (custom attention, `jaxflash.mods`; not on the weights path); bind
    them with `make_attention_fn` to hand the result to a Flax module. A keyword this function
    does not know (a future Flax's) is accepted when it asks for nothing (None / False); with
    any other value it raises NotImplementedError rather than being silently ignored.
    """
    del force_fp32_for_softmax  # softmax statistics are float32 on every path
    asked = {k: v for k, v in unknown.items() if v is not None and v is not False}
    if asked:
        raise NotImplementedError(
            f"jaxflash attention_fn does not know the keyword(s) {sorted(asked)} (values "
            f"{asked!r}); it will not ignore them. Use Flax's own attention for this call.")
    q, k, v = _promote(query, key, value, dtype, promote_dtype)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask != 0  # Flax masks are often float 0/1; Flax treats nonzero as "attend"
    if attention_precision not in (None, "fp8"):
        raise ValueError(f"attention_precision must be None or 'fp8'; got {attention_precision!r}")
    extra = dict(scale=scale, softcap=softcap, local_window_size=local_window_size)
    mods = {k: f for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod), ("aux", aux))
            if f is not None}

    det = _static_bool(deterministic)
    want_dropout = dropout_rate > 0.0 and det is not True
    reasons = []
    if want_dropout:
        reasons.append(f"attention dropout (rate {dropout_rate})")
    if module is not None:
        reasons.append("sowing attention weights (module given)")
    if (einsum_dot_general is not None or qk_attn_weights_einsum is not None
            or attn_weights_value_einsum is not None):
        reasons.append("custom einsum / dot_general")
    if q.dtype not in _FAST_DTYPES:
        reasons.append(f"dtype {q.dtype} (flash path takes float16, bfloat16, float32)")
    if not reasons:
        _record(None)
        return flash_attention(q, k, v, bias, mask, is_causal=is_causal,
                               implementation=implementation, precision=attention_precision,
                               **extra, **mods)
    if mods:
        raise NotImplementedError(
            f"score_mod / mask_mod on Flax's attention-weights path ({', '.join(reasons)}): "
            f"the mods run in jaxflash's flash path only")
    if attention_precision is not None:
        reasons.append(f"(attention_precision={attention_precision!r} not applied: the weights "
                       f"path is float)")
    _record(", ".join(reasons))
    if want_dropout and dropout_rng is None:
        raise ValueError(f"attention dropout (rate {dropout_rate}, deterministic="
                         f"{deterministic!r}) needs dropout_rng; got None")
    return _weights_path(q, k, v, bias, mask, is_causal=is_causal, extra=extra,
                         dropout=(dropout_rate, dropout_rng, broadcast_dropout, deterministic)
                         if want_dropout else None,
                         precision=precision, module=module, dot_general=einsum_dot_general,
                         qk_einsum=qk_attn_weights_einsum, pv_einsum=attn_weights_value_einsum)


def make_attention_fn(implementation: Optional[str] = None, *, is_causal: bool = False,
                      **options):
    """`attention_fn` with jaxflash options bound (``implementation``, ``scale``, ``softcap``,
    ``local_window_size``, ``attention_precision``, ``score_mod`` / ``mask_mod`` / ``aux``,
    ``is_causal``), e.g.
    ``nnx.MultiHeadAttention(..., attention_fn=make_attention_fn(implementation="pallas"))``.
    ``is_causal=True`` masks causally whatever the layer passes (Flax's layers pass their own
    ``is_causal``, False by default), except a single query against longer keys: a decode step
    of Flax's KV cache, which Flax masks itself. Keeps an inspectable signature (Linen filters keywords
    by it)."""
    allowed = {"scale", "softcap", "local_window_size", "attention_precision", "score_mod",
               "mask_mod", "aux"}
    bad = set(options) - allowed
    if bad:
        raise ValueError(f"make_attention_fn: unknown options {sorted(bad)}; allowed: "
                         f"{sorted(allowed | {'implementation', 'is_causal'})}")
    fn = functools.partial(attention_fn, implementation=implementation, **options)
    if not is_causal:
        return fn

    @functools.wraps(attention_fn)
    def causal_fn(*args, is_causal=False, **kwargs):
        # A single query against a longer key sequence is a decode step of Flax's own cache
        # (its mask already stops at the cache index); a top-left causal mask would leave it
        # key 0 alone.
        q, k = args[0], args[1]
        step = q.shape[-3] == 1 and k.shape[-3] > 1
        return fn(*args, is_causal=is_causal or not step, **kwargs)

    causal_fn.__signature__ = inspect.signature(fn)
    return causal_fn


def _weights_path(q, k, v, bias, mask, *, is_causal, extra, dropout, precision, module,
                  dot_general, qk_einsum, pv_einsum):
    """Explicit softmax weights with jaxflash semantics, then Flax-style sow and dropout."""
    dtype = q.dtype
    batch_shape = q.shape[:-3]
    T, N, H = q.shape[-3:]
    S, K = k.shape[-3], k.shape[-2]
    # Validation and canonical masks/options exactly as flash_attention would see them.
    _, _, _, arrays, statics, _ = _prepare(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), bias, mask,
        scale=extra["scale"], is_causal=is_causal, query_seq_lengths=None,
        key_value_seq_lengths=None, local_window_size=extra["local_window_size"],
        softcap=extra["softcap"], alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None,
        implementation=None, deterministic=False)

    G = N // K
    if G > 1:  # custom einsums take the plain MHA subscripts; repeat kv heads for them
        k = jnp.repeat(k, G, axis=-2)
        v = jnp.repeat(v, G, axis=-2)
    if qk_einsum is None or pv_einsum is None:
        default = functools.partial(jnp.einsum, precision=precision,
                                    _dot_general=dot_general or jax.lax.dot_general)
    qk = qk_einsum or default
    pv = pv_einsum or default
    # Scale the query before the product, as Flax does (keeps custom einsums' inputs small).
    qs = (q.astype(jnp.float32) * statics.scale).astype(dtype)
    s = qk("...qhd,...khd->...hqk", qs, k).astype(jnp.float32)       # [B..., N, T, S]
    s = s.reshape((-1, N, T, S))
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]
    k_idx = jnp.arange(S, dtype=jnp.int32)[None, :]
    s = masking.transform_logits(s, q_idx, k_idx, scale=1.0, softcap=statics.softcap,
                                 bias=arrays.bias)
    keep = masking.keep(q_idx, k_idx, is_causal=statics.is_causal, window=statics.window)
    p, _ = reference.masked_softmax(s, keep, arrays.mask)  # all-masked rows: weights 0
    w = p.reshape(batch_shape + (N, T, S)).astype(dtype)

    if module is not None:
        _sow(module, w)
    if dropout is not None:
        rate, rng, broadcast, deterministic = dropout
        keep_prob = 1.0 - rate
        if broadcast:  # one mask shared over batch and heads, as Flax draws it
            shape = (1,) * (len(batch_shape) + 1) + (T, S)
        else:
            shape = w.shape
        keep_m = jax.random.bernoulli(rng, keep_prob, shape)
        mult = keep_m.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
        if _static_bool(deterministic) is None:  # traced flag: decide at run time
            mult = jnp.where(deterministic, jnp.ones_like(mult), mult)
        w = w * mult
    return pv("...hqk,...khd->...qhd", w, v).astype(dtype)


def _sow(module, weights):
    """Store the weights where Flax's own attention would."""
    try:
        from flax import linen
        if isinstance(module, linen.Module):
            module.sow("intermediates", "attention_weights", weights)
            return
    except ImportError:  # pragma: no cover - flax is a dependency of this module's users
        pass
    from flax import nnx
    module.sow(nnx.Intermediate, "attention_weights", weights)
