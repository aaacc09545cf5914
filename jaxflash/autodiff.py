"""The one `jax.custom_vjp` for every backend.

The forward saves only q, k, v, the optional operands, out and lse (O(T + S) per head beyond the
inputs), and the backward hands them to the backend's backward. The LSE output carries no
gradient (the public API stops it, as jax.nn does); ring attention, which does need to combine
partial results through their LSE, calls the backends' forward/backward directly with the
global out and lse instead of differentiating through this function.

Both passes go through `jaxflash.sharding`, which partitions them over sharded batch / head dims
under jit (and is a plain call otherwise).
"""
from __future__ import annotations

import functools

import jax

from jaxflash import _vma, sharding
from jaxflash._types import AttentionArrays
from jaxflash.fp8 import layout, prologue


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def _attention(backend, q, k, v, arrays, statics, plan):
    return sharding.forward(backend, q, k, v, arrays, statics, plan)


def _fwd(backend, q, k, v, arrays, statics, plan):
    out, lse = _forward(backend, q, k, v, arrays, statics, plan)
    return (out, lse), (q, k, v, arrays, out, lse)


def _bwd(backend, statics, plan, res, cts):
    q, k, v, arrays, out, lse = res
    dout, _ = cts  # the LSE's cotangent is dropped: see the module docstring
    grads = _backward(backend, q, k, v, arrays, statics, plan, out, lse, dout)
    dq, dk, dv, dbias, dalibi = grads[:5]
    # With mods the backend adds the aux leaves' cotangents (None where a leaf has none).
    daux = grads[5] if len(grads) > 5 else (None,) * len(arrays.mod_aux)
    scales = {}
    if statics.fp8 is not None and statics.fp8.source == "fp8":
        # FP8 operands given by the caller: the chain rule through dequantization
        # (`jaxflash.fp8.layout`), an FP8 cotangent per operand and a float32 one per scale.
        spec = statics.fp8
        dq, scales["q_scale"] = layout.fp8_cotangents(q, arrays.q_scale, spec.q_block, dq)
        dk, scales["k_scale"] = layout.fp8_cotangents(k, arrays.k_scale, spec.k_block, dk)
        dv, scales["v_scale"] = layout.fp8_cotangents(v, arrays.v_scale, spec.v_block, dv)
    darrays = AttentionArrays(
        bias=None if arrays.bias is None else _as_primal(dbias, arrays.bias),
        alibi_slopes=(None if arrays.alibi_slopes is None
                      else _as_primal(dalibi, arrays.alibi_slopes)),
        mod_aux=tuple(None if g is None else _as_primal(g, x)
                      for g, x in zip(daux, arrays.mod_aux)),
        **{n: _as_primal(g, getattr(arrays, n)) for n, g in scales.items()})
    return _as_primal(dq, q), _as_primal(dk, k), _as_primal(dv, v), darrays


_attention.defvjp(_fwd, _bwd)


def _as_primal(ct, x):
    """`ct` with the type a custom_vjp's cotangent for primal `x` must have: x's dtype and, on
    a mesh with Explicit axes, x's sharding (a small operand's cotangent, a scale's or an aux
    table's summed over the batch, comes out sharded like the large ones it is made of). Auto
    axes: the partitioner places it, no reshard."""
    return _sharded_like(ct.astype(x.dtype), x)


def _sharded_like(ct, x):
    """`ct` resharded to x's sharding where x's type has Explicit axes, and varying over the
    manual axes x varies over inside a caller's shard_map (else unchanged)."""
    ct = _vma.vary(ct, _vma.varying_axes(x))
    sh = _vma.typed_sharding(x)
    return ct if sh is None else jax.sharding.reshard(ct, sh)


# A kernel's forward and backward are not differentiable themselves. A first derivative
# never differentiates them (the custom_vjp above pairs them); a second one (grad of grad)
# differentiates the code of `_fwd` and `_bwd`, and raises NotImplementedError with the reason
# instead of failing inside a kernel's lowering. The XLA backend's passes are plain JAX and
# differentiate again.


def _forward(backend, q, k, v, arrays, statics, plan):
    if backend.differentiable_backward:
        return sharding.forward(backend, q, k, v, arrays, statics, plan)
    return _first_order_forward(backend, q, k, v, arrays, statics, plan)


def _backward(backend, q, k, v, arrays, statics, plan, out, lse, dout):
    if backend.differentiable_backward:
        return sharding.backward(backend, q, k, v, arrays, statics, plan, out, lse, dout)
    return _first_order_backward(backend, q, k, v, arrays, statics, plan, out, lse, dout)


def _no_second_order(backend, statics, plan, primals, tangents):
    raise NotImplementedError(
        f"second-order gradients through the '{backend.name}' backend: its kernels have no "
        f"derivative of their own; implementation='xla' differentiates twice")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 5, 6))
def _first_order_forward(backend, q, k, v, arrays, statics, plan):
    return sharding.forward(backend, q, k, v, arrays, statics, plan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 5, 6))
def _first_order_backward(backend, q, k, v, arrays, statics, plan, out, lse, dout):
    return sharding.backward(backend, q, k, v, arrays, statics, plan, out, lse, dout)


_first_order_forward.defjvp(_no_second_order)
_first_order_backward.defjvp(_no_second_order)


def attention(backend, q, k, v, arrays, statics, plan):
    """Differentiable ``(out, lse)`` through `backend`'s own forward and backward, both
    following the call's `jaxflash.dispatch.Plan`.

    A backend whose passes are plain JAX (the XLA reference) is differentiated by JAX itself
    under `jax.checkpoint` instead: the same gradients and residuals (the inputs; the T x S
    scores are recomputed), every transformation works, forward mode (`jvp`, `jacfwd`,
    Hessians) included, which a `custom_vjp` refuses, and XLA's own SPMD partitioner shards
    it (plain einsums and element-wise ops over batch and heads). On Explicit mesh axes it
    runs per shard under `shard_map` (`jaxflash.sharding`), which JAX differentiates too."""
    if backend.differentiable_backward:
        def run(q, k, v, arrays):
            if sharding.explicit_mesh(q, k, v, arrays) is not None:
                # operands sharded in their types: per shard under shard_map (differentiable)
                return sharding.forward(backend, q, k, v, arrays, statics, plan)
            return backend.forward(q, k, v, arrays, statics, plan)
        return jax.checkpoint(run)(q, k, v, arrays)
    return _attention(backend, *_vary_alike(q, k, v, arrays), statics, plan)


def _vary_alike(*operands):
    """Inside a caller's shard_map (varying-axes checks on): every operand typed as varying
    over the axes any of them does, before a custom_vjp (see `jaxflash.sharding`)."""
    return _vma.vary(operands, _vma.varying_axes(*operands))


# ---------------------------------------------------------------------------------------------
# FP8. A backend's FP8 backward returns float32 gradients with respect to the dequantized
# operands: for FP8 operands given by the caller `_bwd` maps them through the dequantization;
# for float inputs quantized here they go straight through (below).


def fp8_attention(backend, q8, k8, v8, arrays, statics, plan):
    """FP8 operands given by the caller (scales in `arrays`): differentiable ``(out, lse)``.
    The gradients are the chain rule through dequantization (`jaxflash.fp8.layout`): an FP8
    cotangent for each FP8 operand and a float32 one for each scale."""
    return _attention(backend, *_vary_alike(q8, k8, v8, arrays), statics, plan)


def _quantize_all(q, k, v, arrays, statics, platform, signs):
    spec = statics.fp8
    q = prologue.zero_past_length(q, arrays.q_seqlen)
    k = prologue.zero_past_length(k, arrays.kv_seqlen)
    v = prologue.zero_past_length(v, arrays.kv_seqlen)
    g = spec.granularity
    q8, qs = prologue.quantize_operand(q, spec.q_dtype, g[0], spec.q_block, signs,
                                       platform=platform)
    k8, ks = prologue.quantize_operand(k, spec.k_dtype, g[1], spec.k_block, signs,
                                       platform=platform)
    v8, vs = prologue.quantize_operand(v, spec.v_dtype, g[2], spec.v_block, None,
                                       platform=platform)
    return q8, k8, v8, (qs, ks, vs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def _fp8_quantized(backend, q, k, v, arrays, statics, plan, signs):
    return _fp8_quantized_fwd(backend, q, k, v, arrays, statics, plan, signs)[0]


def _fp8_quantized_fwd(backend, q, k, v, arrays, statics, plan, signs):
    q8, k8, v8, (qs, ks, vs) = _quantize_all(q, k, v, arrays, statics, plan.platform, signs)
    arr8 = arrays._replace(q_scale=qs, k_scale=ks, v_scale=vs)
    out, lse = _forward(backend, q8, k8, v8, arr8, statics, plan)
    zero = lambda x: jax.numpy.zeros((), x.dtype)
    return (out, lse), (q8, k8, v8, arr8, out, lse, (zero(q), zero(k), zero(v)), signs)


def _fp8_quantized_bwd(backend, statics, plan, res, cts):
    q8, k8, v8, arr8, out, lse, dtypes, signs = res
    dout, _ = cts
    dq, dk, dv, dbias, dalibi = _backward(backend, q8, k8, v8, arr8, statics, plan, out, lse,
                                          dout)
    darrays = AttentionArrays(
        bias=None if arr8.bias is None else dbias.astype(arr8.bias.dtype),
        alibi_slopes=None if arr8.alibi_slopes is None else dalibi.astype(jax.numpy.float32))
    qd, kd, vd = (d.dtype for d in dtypes)
    # q8 / k8 / v8 are typed like the float inputs they quantize: each gradient takes that
    # type (on Explicit axes, a split the kernels had to run whole is split again here).
    dq, dk, dv = (_sharded_like(g.astype(d), x) for g, x, d in ((dq, q8, qd), (dk, k8, kd),
                                                                (dv, v8, vd)))
    dsigns = None
    if signs is not None:
        # Straight through the quantization, then the Hadamard transform's transpose (what
        # autodiff of `hadamard_signed` gives); the signs are constants of the call.
        dq = prologue.hadamard_transpose(dq, signs, plan.platform)
        dk = prologue.hadamard_transpose(dk, signs, plan.platform)
        dsigns = jax.numpy.zeros_like(signs)
    return dq, dk, dv, darrays, dsigns


_fp8_quantized.defvjp(_fp8_quantized_fwd, _fp8_quantized_bwd)


def fp8_quantized_attention(backend, q, k, v, arrays, statics, plan, signs=None):
    """precision="fp8" on float q, k, v: quantized here by ``statics.fp8`` (amax scales, the
    rules of `jaxflash.quantize`; with `signs`, the random-sign Hadamard transform of q and k
    first, ``quantize.hadamard_signed``), run in FP8, differentiable ``(out, lse)`` with
    straight-through gradients (the FP8 backward's, with respect to the dequantized operands,
    returned in the inputs' dtypes, through the Hadamard transform's transpose)."""
    q, k, v, arrays = _vary_alike(q, k, v, arrays)
    return _fp8_quantized(backend, q, k, v, arrays, statics, plan, signs)
