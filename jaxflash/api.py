"""The public entry point: validate, bring into canonical form, dispatch, restore shapes."""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _vma, autodiff, dispatch, precision as prec, quantize
from jaxflash import mods as _mods
from jaxflash._types import GPU_PLATFORMS, AttentionArrays, AttentionStatics, Problem, accum_dtype
from jaxflash.fp8 import prologue

# float64 exists only under jax_enable_x64 (jnp.asarray makes NumPy float64 float32 otherwise);
# the XLA reference serves it in float64, the kernels refuse it.
_FLOAT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                 jnp.dtype(jnp.float64))


def _shape(x):
    return tuple(np.shape(x))


def _static_scalar(x, name):
    """A one-element array (NumPy or a concrete JAX array) as a Python float: the softcap (and
    a concrete scale) is compiled into the kernels, so a traced value is refused with the
    reason (`flash_attention` folds a traced scale into the query)."""
    if isinstance(x, (np.ndarray, np.generic, jax.Array)) and np.size(x) == 1 and \
            not isinstance(x, (bool, np.bool_)):
        try:
            return float(x.reshape(()))
        except jax.errors.ConcretizationTypeError:
            raise ValueError(f"{name} must be a concrete number (it is compiled into the "
                             f"kernel); got a traced value {x!r}: pass it as a Python float, "
                             f"or mark it static under jit") from None
    return x


def _prepare(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
             key_value_seq_lengths, local_window_size, softcap, alibi_slopes, q_segment_ids,
             kv_segment_ids, implementation, deterministic, allow_empty=False, allow_fp8=False,
             score_mod=None, mask_mod=None, aux=(), block_mask=None):
    """Validate a call; return (q, k, v, arrays, statics, batch_shape) in canonical form.
    ``allow_empty``: accept zero-sized batch dims, T = 0 and S = 0 (`flash_attention` and
    `explain` handle them before any backend; other callers get the ValueError).
    ``allow_fp8``: accept FP8 q, k, v (all three; the caller validated the request with
    `jaxflash.precision.fp8_request` and adds the scales)."""
    if implementation is not None and implementation not in dispatch.IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {dispatch.IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    qs, ks, vs = q.shape, k.shape, v.shape
    shapes = f"query {qs}, key {ks}, value {vs}"
    if q.ndim < 3:
        raise ValueError(f"query must be [B..., T, N, H] (at least 3 dims); got {shapes}")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"query, key and value must have the same rank; got {shapes}")
    fp8 = allow_fp8 and all(quantize.is_fp8(x.dtype) for x in (q, k, v))
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype not in _FLOAT_DTYPES and not fp8:
            raise ValueError(f"{name} dtype must be float16, bfloat16, float32 or float64"
                             + (" (FP8 through flash_attention with scales)"
                                if quantize.is_fp8(x.dtype) else "") + f"; got {x.dtype}")
    if not fp8 and not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"query, key and value must share a dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    batch_shape = qs[:-3]
    if ks[:-3] != batch_shape or vs[:-3] != batch_shape:
        raise ValueError(f"batch dims of query, key and value differ; got {shapes}")
    T, N, H = qs[-3:]
    S, K, Hk = ks[-3:]
    Sv, Kv, Hv = vs[-3:]
    if not all(isinstance(d, int) for d in (N, H, K, Hv)):
        raise NotImplementedError(f"symbolic head counts or head dims (jax.export): only the "
                                  f"batch and sequence dims may be symbolic; got {shapes}")
    # Zero-sized batch dims, T = 0 and S = 0 are valid (see flash_attention: "Empty and
    # degenerate shapes"); head counts and head dims are not (no grouping, no default scale).
    if min(N, H, K, Hv) <= 0:
        raise ValueError(f"head counts and head dims (N, K, H, Hv) must be positive; got "
                         f"{shapes}")
    if not allow_empty and min(batch_shape + (T, S)) <= 0:
        raise ValueError(f"batch dims, T and S must be positive for this entry point "
                         f"(flash_attention accepts empty calls); got {shapes}")
    if Sv != S:
        raise ValueError(f"key and value sequence lengths differ ({S} vs {Sv}); got {shapes}")
    if Kv != K:
        raise ValueError(f"key and value head counts differ ({K} vs {Kv}); got {shapes}")
    if Hk != H:
        raise ValueError(f"query and key head dims differ ({H} vs {Hk}); got {shapes}")
    if N % K != 0:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({K}); "
                         f"got {shapes}")
    B = math.prod(batch_shape)   # a symbolic product under jax.export shape polymorphism
    nb = len(batch_shape)
    full = batch_shape + (N, T, S)

    # Scalars.
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    scale = _static_scalar(scale, "scale")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number; got {scale!r}")
    if softcap is not None:
        softcap = _static_scalar(softcap, "softcap")
        if (not isinstance(softcap, numbers.Real) or isinstance(softcap, bool)
                or not math.isfinite(softcap) or softcap <= 0):
            raise ValueError(f"softcap must be a positive finite number or None; got {softcap!r}")
        softcap = float(softcap)
    window = None
    if local_window_size is not None:
        w = local_window_size
        if isinstance(w, numbers.Integral) and not isinstance(w, bool):
            w = (w, w)
        if (not isinstance(w, (tuple, list)) or len(w) != 2
                or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in w)):
            raise ValueError(f"local_window_size must be an int or a (left, right) pair of ints; "
                             f"got {local_window_size!r}")
        # as jax.nn: a negative bound moves the window off the diagonal ((-1, 3): keys i + 1
        # to i + 3); only the reference serves those (`dispatch.reference_only`)
        window = (int(w[0]), int(w[1]))

    def dense(x, name, want_bool):
        if x is None:
            return None
        x = jnp.asarray(x)
        # jax.nn's 4-D [B, N, T, S] with inputs that have no batch dim: its B of 1 is no dim
        if nb == 0 and x.ndim == 4 and x.shape[0] == 1:
            x = x.reshape(x.shape[1:])
        if want_bool and x.dtype != jnp.bool_:
            raise ValueError(f"{name} must be boolean (True = attend); got dtype {x.dtype}")
        if not want_bool and not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)   # an integer or boolean bias adds its values, as in jax.nn
        if x.ndim > len(full):
            raise ValueError(f"{name} shape {x.shape} has more dims than [B..., N, T, S] = {full}")
        # dim by dim: symbolic dims (jax.export) are equal only to themselves
        if not all(d == 1 or d == f for d, f in zip(x.shape[::-1], full[::-1])):
            raise ValueError(f"{name} shape {x.shape} does not broadcast to [B..., N, T, S] = "
                             f"{full} (query {qs}, key {ks})")
        x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
        # Keep size-1 batch/head dims (backends broadcast them without copies); expand T, S.
        bdims = x.shape[:nb]
        bb = 1 if all(d == 1 for d in bdims) else B
        x = jnp.broadcast_to(x, (batch_shape if bb != 1 else (1,) * nb) + x.shape[nb:nb + 1]
                             + (T, S))
        return x.reshape(bb, x.shape[nb], T, S)

    bias_c = dense(bias, "bias", False)
    mask_c = dense(mask, "mask", True)

    def lengths(x, name, bound):
        if x is None:
            return None
        x = jnp.asarray(x)
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32; got {x.dtype}")
        if _shape(x) != (batch_shape if nb else (1,)) and not (nb == 0 and x.ndim == 0):
            raise ValueError(f"{name} must have shape {batch_shape or (1,)} (the batch dims); "
                             f"got {x.shape}")
        return x.reshape(B)

    qlen_c = lengths(query_seq_lengths, "query_seq_lengths", T)
    kvlen_c = lengths(key_value_seq_lengths, "key_value_seq_lengths", S)

    alibi_c = None
    if alibi_slopes is not None:
        a = jnp.asarray(alibi_slopes)
        if a.shape != (N,):
            raise ValueError(f"alibi_slopes must have shape (N,) = ({N},); got {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"alibi_slopes must be floating; got {a.dtype}")
        alibi_c = a.astype(accum_dtype(q.dtype))

    qseg_c = kvseg_c = None
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        qsg, kvsg = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        for name, x, want in (("q_segment_ids", qsg, batch_shape + (T,)),
                              ("kv_segment_ids", kvsg, batch_shape + (S,))):
            if x.dtype != jnp.int32:
                raise ValueError(f"{name} must be int32; got {x.dtype}")
            if x.shape != want:
                raise ValueError(f"{name} must have shape [B..., {'T' if 'q_' in name else 'S'}]"
                                 f" = {want}; got {x.shape}")
        qseg_c, kvseg_c = qsg.reshape(B, T), kvsg.reshape(B, S)

    mods, aux_c = _mods.make_spec(score_mod, mask_mod, aux)
    if mods is not None:  # the ready-made mods' aux shapes, as the built-ins check theirs
        _mods.library.check_aux((score_mod, mask_mod), _mods.normalize_aux(aux), B, N, T, S)
    _check_block_mask(block_mask, mods, B, N, T, S, shapes)
    mods_note = None
    form = None if (is_causal or window is not None) else _builtin_mask_form(mods, T, S)
    if form is not None:  # the mask_mod is a built-in mask: run it as that (same result)
        is_causal, window = form
        mods_note = (f"mask_mod {getattr(mask_mod, '__name__', 'mask')} equals the built-in "
                     f"{_describe_mask(is_causal, window)} at (T, S) = ({T}, {S}): runs as that")
        if block_mask is not None:
            # A block mask of the same mask_mod (what it must be) marks exactly the tiles the
            # built-in skips by its bounds: the built-in needs no table.
            mods_note += " (the block_mask is not needed there)"
            block_mask = None
        mods, aux_c = _mods.make_spec(score_mod, None, aux if score_mod is not None else ())
    arrays = AttentionArrays(bias=bias_c, mask=mask_c, q_seqlen=qlen_c, kv_seqlen=kvlen_c,
                             alibi_slopes=alibi_c, q_segment_ids=qseg_c, kv_segment_ids=kvseg_c,
                             mod_aux=aux_c, block_mask=block_mask)
    statics = AttentionStatics(scale=float(scale), is_causal=bool(is_causal), window=window,
                               softcap=softcap, deterministic=bool(deterministic), mods=mods,
                               mods_note=mods_note)
    q = q.reshape((B,) + qs[-3:])
    k = k.reshape((B,) + ks[-3:])
    v = v.reshape((B,) + vs[-3:])
    return q, k, v, arrays, statics, batch_shape


def _builtin_mask_form(mods, T: int, S: int):
    """`jaxflash.kernels.mod_builtin.builtin_form` of the call's mask_mod, or None (no
    mask_mod, one the kernels' program form cannot express, or no built-in)."""
    if mods is None or mods.mask_mod is None:
        return None
    from jaxflash.kernels import mod_builtin
    from jaxflash.kernels.variants.mod_program import program_from_jaxpr, to_text
    from jaxflash.mods.spec import mask_jaxpr
    if not (isinstance(T, int) and isinstance(S, int)):
        return None   # symbolic lengths (jax.export): the form is told on a concrete grid
    try:
        text = to_text(program_from_jaxpr(mask_jaxpr(mods), "mask"))
    except (NotImplementedError, ValueError):
        return None
    return mod_builtin.builtin_form(text, T, S)


def _describe_mask(is_causal: bool, window) -> str:
    if window is None:
        return "causal mask" if is_causal else "no mask (every pair visible)"
    return ("causal " if is_causal else "") + f"window local_window_size={tuple(window)}"


def _check_block_mask(block_mask, mods, B, N, T, S, shapes):
    if block_mask is None:
        return
    if not isinstance(block_mask, _mods.BlockMask):
        raise ValueError(f"block_mask must be a jaxflash.mods.BlockMask (from "
                         f"create_block_mask); got {type(block_mask).__name__}")
    if mods is None or mods.mask_mod is None:
        raise ValueError("block_mask needs the mask_mod it was built from (mask_mod=...)")
    if tuple(block_mask.seq_lens) != (T, S):
        raise ValueError(f"block_mask was built for (T, S) = {tuple(block_mask.seq_lens)}; "
                         f"this call has ({T}, {S}) ({shapes})")
    Bm, Hm = block_mask.batch_heads
    if Bm not in (1, B) or Hm not in (1, N):
        raise ValueError(f"block_mask was built for (B, H) = ({Bm}, {Hm}); this call needs "
                         f"B in (1, {B}) and H in (1, {N}) (batch dims flattened; {shapes})")
    reads = _mods.spec.mask_reads(mods)
    for dim, built, n in (("b", Bm, B), ("h", Hm, N)):
        if built == 1 and n > 1 and dim in reads:
            what = "batch" if dim == "b" else "head"
            raise ValueError(f"block_mask was built for one {what} ({'B' if dim == 'b' else 'H'}"
                             f" = 1), but the mask_mod reads {dim!r}: its tiles differ per "
                             f"{what}; build it with {'B' if dim == 'b' else 'H'} = {n} "
                             f"({shapes})")


def flash_attention(query, key, value, bias=None, mask=None, *, scale: Optional[float] = None,
                    is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                    local_window_size=None, return_residual: bool = False,
                    softcap: Optional[float] = None, alibi_slopes=None, q_segment_ids=None,
                    kv_segment_ids=None, implementation: Optional[str] = None,
                    deterministic: bool = False, precision: Optional[str] = None,
                    q_scale=None, k_scale=None, v_scale=None, out_dtype=None,
                    hadamard: Optional[bool] = None, hadamard_seed=None, scale_block: int = 128,
                    scale_granularity: str = "block", dout_dtype=None, emulate: bool = False,
                    score_mod=None, mask_mod=None, aux=(), block_mask=None):
    """Scaled dot-product attention with the layout and meaning of `jax.nn.dot_product_attention`.

    query ``[B..., T, N, H]``, key ``[B..., S, K, H]``, value ``[B..., S, K, Hv]`` with N a
    multiple of K (MHA, GQA, MQA). Logits are built in this order: ``scale``, ``softcap``
    (``softcap * tanh(x / softcap)``), ALiBi (``-alibi_slopes[n] * |i - j|``), ``bias``; then
    every mask (``mask``, ``is_causal``, ``local_window_size``, the sequence lengths, the segment
    ids) removes keys. Softmax statistics are float32; the output has the query's dtype.
    float64 inputs (under ``jax_enable_x64``) run on the XLA reference in float64, LSE too.
    A traced ``scale`` (a learned temperature under jit) multiplies the query before the
    kernels, in the query's dtype: one more rounding, and in float16 ``|query * scale|`` must
    stay below 65504 (a static scale multiplies the float32 logits, as jax.nn does).

    One deliberate difference from jax.nn: a query row with no key left to attend to gives
    output 0, a finite gradient and LSE = -inf.

    Empty and degenerate shapes: a zero-sized batch dim or T = 0 gives an empty output (and
    LSE) of the right shapes; S = 0 leaves every query row without a key, so output 0 and
    LSE -inf. Gradients of an empty call are 0 (empty where the input is). No backend runs
    for an empty call (no kernel is launched), but a backend named by ``implementation``
    must still serve its configuration. N, K, H and Hv must be positive (ValueError).
    T = 1, S = 1, N = K = 1 and inputs that are transposed, sliced or broadcast views are
    ordinary calls; so is a size-0 `jax.vmap` axis (an empty call).

    Non-finite values (NaN, +-Inf in query, key, value, bias) are not checked for; no backend
    hangs or raises on them, and the forward follows the reference: a pair (i, j) removed by
    a mask never contributes. A NaN logit (NaN in query row i, key j or bias[..., i, j])
    makes output and LSE of exactly the rows that see it NaN; a row that sees nothing (masked,
    beyond its length) stays 0 / -inf. A -inf logit removes its key, like a mask (all -inf:
    a fully masked row). A +inf logit (+inf bias, or Inf in query/key without softcap) makes
    the row's output NaN and its LSE +inf. A NaN/Inf at ``value[..., j, :, h]`` reaches
    column h of the rows that see key j. Known deviations (tracked as xfails in
    tests/extremes/test_bad_values.py): a NaN/Inf in value also reaches rows for which key j
    is masked (weight 0, and 0 * NaN = NaN): zero the padding of value; and gradients may
    carry a masked NaN key/query into dq/dk of its own problem. Other batch elements are never affected (but the
    gradient of an operand they share, a broadcast bias or alibi_slopes, sums over them).

    Custom attention (`jaxflash.mods`): ``score_mod(score, b, h, q_idx, kv_idx, *aux)`` maps
    each logit (after scale, softcap, ALiBi and bias) to a new one and ``mask_mod(b, h, q_idx,
    kv_idx, *aux)`` says whether the pair may attend (and-ed with every other mask); both are
    plain JAX on scalars (``b`` indexes the flattened batch dims, ``h`` the query head), read
    the arrays of ``aux`` (a tuple; its floating arrays get gradients, and their values never
    enter the compiled code). ``block_mask`` (`jaxflash.mods.create_block_mask` of the same
    mask_mod and aux) lets the kernels skip empty tiles and the mask on full ones.

    ``return_residual=True`` returns ``(out, lse)``, lse ``[B..., T, N]`` float32 (float64 for
    float64 inputs) with its gradient stopped. ``implementation`` is None (best available; see
    `explain`), "cute", "cudnn", "pallas" or "xla". ``deterministic=True`` asks for
    bitwise-reproducible gradients.

    FP8. float8_e4m3fn / float8_e5m2 query, key, value (all three FP8) need ``q_scale``,
    ``k_scale``, ``v_scale``: float32 dequantization scales (value = code * scale) per tensor
    ``()``, per (batch, head) ``[B..., heads]`` or per block of ``scale_block`` sequence rows
    ``[B..., heads, ceil(L / scale_block)]`` -- the layouts `jaxflash.quantize.quantize`
    returns. The output is ``out_dtype`` (bfloat16 by default). ``precision="fp8"`` on float16 /
    bfloat16 / float32 inputs quantizes them here (amax scales per block of ``scale_block``
    rows, or per ``scale_granularity="tensor"`` / ``"head"``; Q and K first through a random-sign Hadamard transform (by default where the head dim is a power of two from 16 to 256; ``hadamard=True`` insists, ``False`` skips it),
    ``hadamard_seed`` an int or a `jax.random` key) and returns the input dtype unless
    ``out_dtype`` says otherwise; its gradients are the FP8 backward's, straight-through to the
    float inputs; ``dout_dtype`` (float8_e5m2 by default, or float8_e4m3fn) is the backward's
    format for the output gradient. Numerics: `jaxflash.fp8.contract`. When no FP8 kernel can serve the call the
    emulated FP8 path runs (``implementation="xla"``, or ``emulate=True``); `explain` says which.
    ``precision="fp4"`` runs `jaxflash.fp4.fp4_attention` (``emulate=True`` without an sm_100a
    GPU; causal or not, no other mask or logit feature).
    """
    req = prec.fp8_request(query, key, value, precision=precision, q_scale=q_scale,
                           k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
                           hadamard=hadamard, hadamard_seed=hadamard_seed,
                           scale_block=scale_block, emulate=emulate,
                           implementation=implementation, scale_granularity=scale_granularity,
                           dout_dtype=dout_dtype)
    if precision == "fp4":
        return _fp4(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                    emulate=emulate, return_residual=return_residual,
                    implementation=implementation,
                    others=_fp4_others(locals()))
    if req is not None:
        implementation = req.implementation
    query, q_scale, scale = fold_traced_scale(scale, query, q_scale, req)
    q, k, v, arrays, statics, batch_shape = _prepare(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        implementation=implementation, deterministic=deterministic, allow_empty=True,
        allow_fp8=req is not None and req.spec.source == "fp8", score_mod=score_mod,
        mask_mod=mask_mod, aux=aux, block_mask=block_mask)
    if req is not None:
        statics = dataclasses.replace(statics, fp8=req.spec)
        if req.spec.source == "fp8":
            qs, ks, vs = prec.canonical_scales(req, q_scale, k_scale, v_scale, batch_shape,
                                               q.shape[2], k.shape[2])
            arrays = arrays._replace(q_scale=qs, k_scale=ks, v_scale=vs)
    problem = _problem(q, k, v, arrays, statics)
    if _is_empty(problem) or _mapped_empty(q, k, v):
        # No backend runs (no kernel is ever launched on an empty grid); a named backend must
        # still serve the call's configuration, as it must when the call is not empty.
        dispatch.select(_nonempty(problem), implementation)
        out, lse = _empty_result(q, v, None if req is None else req.spec.out_dtype)
    else:
        backend, plan = dispatch.select(problem, implementation)
        source = None if req is None else req.spec.source
        # The random-sign Hadamard transform of Q and K is part of the quantizing prologue
        # (`jaxflash.fp8.prologue`: one pass over each operand where a kernel does it).
        signs = (quantize.hadamard_signs(req.hadamard_seed, q.shape[-1])
                 if source == "quantized" and req.spec.hadamard else None)
        # Outside any trace the call runs as one jitted program, compiled once per
        # configuration (op by op, each Pallas kernel would compile again at every call).
        run = _attend if isinstance(q, _Tracer) else _attend_jit
        out, lse = run(backend, q, k, v, arrays, statics, plan, source, signs)
    T, N = q.shape[1], q.shape[2]
    out = out.reshape(batch_shape + out.shape[1:])
    if not return_residual:
        return out
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(accum_dtype(q.dtype)))
    return out, lse.reshape(batch_shape + (T, N))


def _attend(backend, q, k, v, arrays, statics, plan, source, signs):
    """Differentiable (out, lse) of a planned call: float inputs, FP8 inputs with their scales
    (``source == "fp8"``), or float inputs quantized here (``"quantized"``)."""
    if source is None:
        return backend(q, k, v, arrays, statics, plan)
    if source == "fp8":
        return autodiff.fp8_attention(backend, q, k, v, arrays, statics, plan)
    return autodiff.fp8_quantized_attention(backend, q, k, v, arrays, statics, plan, signs)


_attend_jit = jax.jit(_attend, static_argnums=(0, 5, 6, 7))
try:  # any traced value (jit, grad, vmap): the call is part of a larger program already
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover - jax versions that hide it
    from jax._src.core import Tracer as _Tracer


def explain(query, key, value, bias=None, mask=None, *, implementation: Optional[str] = None,
            **kwargs) -> dispatch.Plan:
    """The plan `flash_attention` would follow for these arguments: which backend runs (and,
    for ``cute``, which kernels), and why each other one was refused. Takes the same arguments
    (arrays or `jax.ShapeDtypeStruct`s). ``str()`` it to read."""
    unknown = sorted(set(kwargs) - _FLASH_ATTENTION_KEYWORDS)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {unknown} (it takes "
                        f"flash_attention's)")
    kwargs.pop("return_residual", None)
    fp8_kw = {n: kwargs.pop(n, d) for n, d in _FP8_DEFAULTS.items()}
    req = prec.fp8_request(query, key, value, implementation=implementation, **fp8_kw)
    if fp8_kw["precision"] == "fp4":
        return _explain_fp4(query, key, value, bias, mask, implementation, fp8_kw["emulate"],
                            kwargs, _fp4_others({**kwargs, **fp8_kw}))
    if req is not None:
        implementation = req.implementation
    if isinstance(kwargs.get("scale"), _Tracer):
        kwargs["scale"] = 1.0   # as flash_attention runs it: folded into the query
    q, k, v, arrays, statics, _ = _prepare_abstract(
        query, key, value, bias, mask, implementation=implementation,
        allow_fp8=req is not None and req.spec.source == "fp8", **kwargs)
    if req is not None:
        statics = dataclasses.replace(statics, fp8=req.spec)
    problem = _problem(q, k, v, arrays, statics)
    if not _is_empty(problem):
        return _with_fp8_notes(dispatch.plan(problem, implementation), req, q.dtype)
    p = _with_fp8_notes(dispatch.plan(_nonempty(problem), implementation), req, q.dtype)
    note = (f"empty call (batch {problem.batch}, T {problem.q_len}, S {problem.kv_len}): "
            f"nothing is launched"
            + (f" ('{p.backend}' is what this configuration would run when not empty)"
               if p.backend else "")
            + "; the result is output 0 and LSE -inf in the call's shapes, gradients 0")
    return dataclasses.replace(p, problem=problem, notes=p.notes + (note,))


_FLASH_ATTENTION_PARAMS = inspect.signature(flash_attention).parameters
_FLASH_ATTENTION_KEYWORDS = frozenset(_FLASH_ATTENTION_PARAMS) - {
    "query", "key", "value", "bias", "mask", "implementation"}


def _is_empty(problem: Problem) -> bool:
    """No query row (batch or T is 0) or no key (S is 0): the result needs no backend."""
    # a symbolic dim (jax.export shape polymorphism) is at least 1 by jax's convention
    return any(isinstance(d, int) and d == 0
               for d in (problem.batch, problem.q_len, problem.kv_len))


def _nonempty(problem: Problem) -> Problem:
    """`problem` with its empty dims set to 1: what a backend is asked whether it could serve
    (backends never see a zero-sized dim, not even when planning)."""
    one = lambda d: max(d, 1)
    bias = None if problem.bias_shape is None else tuple(one(d) for d in problem.bias_shape)
    return dataclasses.replace(problem, batch=one(problem.batch), q_len=one(problem.q_len),
                               kv_len=one(problem.kv_len), bias_shape=bias)


def _mapped_empty(*xs) -> bool:
    """Whether a `jax.vmap` axis of size 0 maps any operand (the problem, read per example,
    does not show it): the call is then empty too."""
    for x in xs:
        while isinstance(x, _vma.BatchTracer):
            if isinstance(x.batch_dim, int) and x.val.shape[x.batch_dim] == 0:
                return True
            x = x.val
    return False


def fold_traced_scale(scale, query, q_scale, req):
    """(query, q_scale, scale) with a traced scale (a learned temperature under jit) folded in:
    it is no kernel constant, so it scales the query instead, s (q . k) = (s q) . k, and
    autodiff gives its gradient through the product (FP8 inputs: it scales q's dequantization
    scales, exactly). A static scale comes back as it is."""
    if not isinstance(scale, _Tracer):
        return query, q_scale, scale
    s = jnp.asarray(scale)
    if s.size != 1 or not jnp.issubdtype(s.dtype, jnp.floating):
        raise ValueError(f"scale must be one floating number; got {s.shape} {s.dtype}")
    s = s.reshape(())
    if req is not None and req.spec.source == "fp8":
        q_scale = jnp.asarray(q_scale, jnp.float32) * s.astype(jnp.float32)
    else:
        qx = jnp.asarray(query)
        query = (qx.astype(accum_dtype(qx.dtype)) * s).astype(qx.dtype)
    return query, q_scale, 1.0


def _empty_result(q, v, out_dtype=None):
    """Canonical (out [B,T,N,Hv], lse [B,N,T]) of an empty call: every row has no key to
    attend to (or there is no row), so output 0 and LSE -inf; they depend on no input, so
    every gradient is 0 (empty where the input is)."""
    B, T, N, _ = q.shape
    out = jnp.zeros((B, T, N, v.shape[-1]), out_dtype or q.dtype)
    return out, jnp.full((B, N, T), -jnp.inf, accum_dtype(q.dtype))


def _prepare_abstract(query, key, value, bias, mask, *, implementation=None, allow_fp8=False,
                      **kwargs):
    """`_prepare` on shapes only (no device work), returning abstract canonical operands."""
    kwargs.setdefault("scale", None)
    kwargs.setdefault("is_causal", False)
    for name in ("query_seq_lengths", "key_value_seq_lengths", "local_window_size", "softcap",
                 "alibi_slopes", "q_segment_ids", "kv_segment_ids"):
        kwargs.setdefault(name, None)
    kwargs.setdefault("deterministic", False)
    for name in ("score_mod", "mask_mod", "block_mask"):
        kwargs.setdefault(name, None)
    kwargs.setdefault("aux", ())
    out = {}

    def f(q, k, v, b, m, ql, kl, al, qs, ks, aux, bm):
        r = _prepare(q, k, v, b, m, query_seq_lengths=ql, key_value_seq_lengths=kl,
                     alibi_slopes=al, q_segment_ids=qs, kv_segment_ids=ks,
                     implementation=implementation, allow_empty=True, allow_fp8=allow_fp8,
                     aux=aux, block_mask=bm,
                     **{n: kwargs[n] for n in ("scale", "is_causal", "local_window_size",
                                               "softcap", "deterministic", "score_mod",
                                               "mask_mod")})
        out["statics"] = r[4]
        return r[:4]

    q, k, v, arrays = jax.eval_shape(
        f, query, key, value, bias, mask, kwargs["query_seq_lengths"],
        kwargs["key_value_seq_lengths"], kwargs["alibi_slopes"], kwargs["q_segment_ids"],
        kwargs["kv_segment_ids"], _mods.normalize_aux(kwargs["aux"]), kwargs["block_mask"])
    return q, k, v, arrays, out["statics"], None


_FP8_DEFAULTS = dict(precision=None, q_scale=None, k_scale=None, v_scale=None, out_dtype=None,
                     hadamard=None, hadamard_seed=None, scale_block=128, emulate=False,
                     scale_granularity="block", dout_dtype=None)


def _problem(q, k, v, arrays, statics) -> Problem:
    """The call's `Problem`; an FP8 call's dtype is its query's FP8 dtype (also when
    precision="fp8" quantizes float inputs: that is what a backend computes on)."""
    p = Problem.from_arrays(q, k, v, arrays, statics, dispatch.current_platform())
    if statics.fp8 is not None:
        p = dataclasses.replace(p, dtype=statics.fp8.q_dtype)
    return p


def _with_fp8_notes(p: dispatch.Plan, req, in_dtype) -> dispatch.Plan:
    if req is None:
        return p
    notes = prec.describe(req.spec, req.hadamard_seed, p.problem.head_dim)
    if req.spec.source == "quantized":
        notes += (prologue.describe(p.problem, req.spec, in_dtype),)
    if p.backend == "cute":
        notes += (_fp8_helpers_note(),)
    if p.backend == "xla":
        why = ("asked for" if p.requested else
               "no FP8 kernel can serve this call (see the refusals)"
               if p.platform in GPU_PLATFORMS else
               f"the FP8 kernels are for Hopper GPUs (platform {p.platform})")
        notes += (f"{prec.EMULATED_NOTE}; {why}",)
    return dataclasses.replace(p, notes=notes + p.notes)


def _fp8_helpers_note() -> str:
    """`explain`'s line on the copies and the dO quantization around the CuTe FP8 kernels."""
    from jaxflash.kernels.variants import keys_major
    km = "Pallas (Triton) kernels" if keys_major.IMPL == "triton" else "XLA transposes"
    rows = "a Pallas (Triton) kernel" if prologue.ROWS_IMPL == "triton" else "XLA"
    return (f"FP8 helpers: the keys-major copies (V^T; the backward's Q^T, K^T, dO^T) by {km}, "
            f"the backward's dO quantized by {rows}; XLA for a length that is not a multiple "
            f"of 128 rows, off arch 9.0 and inside a jit trace of a multi-device process")


_FP8_ONLY_OPTIONS = ("hadamard", "hadamard_seed", "dout_dtype", "scale_block",
                     "scale_granularity")
# flash_attention's options a precision='fp4' call handles itself (or `fp8_request` checks)
_FP4_OWN = ("query", "key", "value", "bias", "mask", "scale", "is_causal", "return_residual",
            "implementation", "precision", "q_scale", "k_scale", "v_scale", "out_dtype",
            "emulate")


def _fp4_others(options: dict) -> dict:
    """The options among `options` (flash_attention's keywords and values) that a
    precision='fp4' call does not take and that differ from their defaults."""
    params = _FLASH_ATTENTION_PARAMS
    return {n: x for n, x in options.items()
            if n in params and n not in _FP4_OWN and x is not params[n].default
            and not (isinstance(x, (bool, int, float, str, tuple)) and x == params[n].default)}


def _fp4_checks(query, key, value, bias, mask, implementation, others, scale=None,
                is_causal=False):
    """precision='fp4' takes q, k, v (causal or not) and the softmax scale, nothing else.
    Returns `_prepare_abstract`'s canonical operands (the shape / dtype rules of every
    call)."""
    if implementation is not None:
        raise ValueError(f"precision='fp4' picks its own path (jaxflash.fp4); implementation "
                         f"must be None, got {implementation!r}")
    used = [n for n, x in (("bias", bias), ("mask", mask)) + tuple(others.items())
            if x is not None]  # `others`: options not at their defaults (`_fp4_others`)
    fp8_only = [n for n in used if n in _FP8_ONLY_OPTIONS]
    if fp8_only:
        raise ValueError(f"{', '.join(fp8_only)}: options of precision='fp8', meaningless with "
                         f"precision='fp4'")
    if used:
        raise NotImplementedError(f"precision='fp4' (jaxflash.fp4) serves plain or causal "
                                  f"attention only; this call also has {', '.join(used)}")
    shapes = [tuple(np.shape(x)) for x in (query, key, value)]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"precision='fp4' takes [B, T, N, H] arrays; got {shapes}")
    return _prepare_abstract(query, key, value, None, None, scale=scale, is_causal=is_causal)


def _fp4(query, key, value, bias, mask, *, scale, is_causal, emulate, return_residual,
         implementation, others):
    from jaxflash.fp4 import frontend
    _fp4_checks(query, key, value, bias, mask, implementation, others)
    if return_residual and is_causal:
        raise NotImplementedError("precision='fp4' returns the LSE only on its non-causal path")
    if isinstance(scale, _Tracer):
        raise NotImplementedError("precision='fp4' takes a static scale (a Python number): "
                                  "the FP4 path's constants are built from it")
    dims = np.shape(query)[:2] + np.shape(key)[1:2]   # (symbolic dims are never 0)
    if any(isinstance(d, int) and d == 0 for d in dims):   # nothing to attend: as any call
        out, lse = _empty_result(jnp.asarray(query), jnp.asarray(value))
        return (out, jnp.swapaxes(lse, -1, -2)) if return_residual else out
    if not is_causal:   # Direct-P, emulated or the kernel: inference only (raises if differentiated)
        from jaxflash.fp4.direct_p import no_derivative
        query, key, value = (no_derivative(x) for x in (query, key, value))
    kernel = _fp4_kernel(query, key, value, is_causal, emulate)
    if frontend._route(emulate, kernel and kernel[:2])[0] == "kernel":
        from jaxflash.kernels import fp4_call
        r = fp4_call.forward(kernel[2], query, key, value, scale=scale,
                             return_lse=bool(return_residual))
    else:
        r = frontend.fp4_attention(query, key, value, is_causal=is_causal, emulate=emulate,
                                   scale=scale, return_lse=bool(return_residual),
                                   kernel=kernel and kernel[:2])
    if return_residual:
        out, lse = r   # lse [B, N, T] from jaxflash.fp4; [B, T, N] as every call returns it
        return out, jax.lax.stop_gradient(jnp.swapaxes(jnp.asarray(lse, jnp.float32), -1, -2))
    return r


def _fp4_kernel(query, key, value, is_causal, emulate):
    """The sm_100a FP4 kernel's verdict (admitted, why, config), or None where no compute
    capability 10.x GPU is visible or the emulation was asked for."""
    from jaxflash.fp4 import frontend
    if emulate or not frontend.has_sm100():
        return None
    from jaxflash.kernels import fp4_call
    return fp4_call.kernel_route(query, key, value, is_causal=bool(is_causal))


def _explain_fp4(query, key, value, bias, mask, implementation, emulate, kwargs, others):
    from jaxflash.fp4 import frontend
    q, k, v, arrays, statics, _ = _fp4_checks(
        query, key, value, bias, mask, implementation, others, scale=kwargs.get("scale"),
        is_causal=kwargs.get("is_causal", False))
    problem = Problem.from_arrays(q, k, v, arrays, statics, dispatch.current_platform())
    causal = bool(kwargs.get("is_causal", False))
    kernel = _fp4_kernel(query, key, value, causal, emulate)
    kernel = kernel and kernel[:2]
    text = frontend.explain_fp4(query, key, value, is_causal=causal, emulate=emulate,
                                kernel=kernel)
    route = frontend._route(emulate, kernel)
    if route[0] == "emulated":
        return dispatch.Plan(problem, "fp4 (emulated, jaxflash.fp4)", (), None, None,
                             tuple(text.splitlines()))
    if route[0] == "kernel":
        return dispatch.Plan(problem, "fp4 (sm_100a kernel, compiled and instruction-checked "
                             "only)", (), None, None, tuple(text.splitlines()))
    return dispatch.Plan(problem, None, (("fp4", route[1]),), None, None,
                         tuple(text.splitlines()))
