"""The XLA-side halves around the CuTe launches of a `jaxflash.kernels.plan.CutePlan`: the
forward's optional inputs and scalars; the backward's O(T) preprocessing (delta, log2 LSE with
+inf on rows that must get no gradient, padded for the kernel's TMA boxes; segment block
summaries), its dQ postprocessing (un-permute, scale, cast) and the d(slopes) reduction.
Everything O(T x S) runs in the kernels."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxflash import ffi
from jaxflash.kernels.common.segments import block_summaries
from jaxflash.kernels.variants.bwd import ALIBI_PARTS
from jaxflash.kernels.variants.bwd_launch import (dq_acc_shape, dq_from_flat, num_k_blocks,
                                                  num_q_blocks, padded_len)
from jaxflash.kernels.variants.fwd_launch import fwd_inputs, fwd_scalars
from jaxflash.kernels import mod_blocks


def forward(launch, q, k, v, arrays, statics):
    """(out [B, T, N, Hv] q.dtype, lse [B, N, T] float32) by the forward `launch`."""
    B, T, N, _ = q.shape
    inputs = fwd_inputs(launch.config, q, k, v, q_seqlen=arrays.q_seqlen,
                        kv_seqlen=arrays.kv_seqlen, alibi_slopes=arrays.alibi_slopes,
                        q_segment_ids=arrays.q_segment_ids, kv_segment_ids=arrays.kv_segment_ids)
    inputs += mod_inputs(launch.config, arrays, q, k, backward=False)
    fs, is_ = fwd_scalars(statics)
    out_shapes = [jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), q.dtype),
                  jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    out, lse = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs, int_scalars=is_)
    return out, lse


def mod_inputs(cfg, arrays, q, k, backward: bool) -> list:
    """A mod variant's extra inputs: the (batch, head) offsets of a shard (zeros unsharded),
    the mask_mod's block range table (from the call's `BlockMask` where its blocks line up
    with the kernel's tiles, else computed here from the same program) and the aux leaves."""
    if not (cfg.score_mod or cfg.mask_mod):
        return []
    B, T, N, _ = q.shape
    _, S, K, _ = k.shape
    aux = tuple(arrays.mod_aux)
    off = arrays.mod_offsets
    ins = [jnp.zeros((2,), jnp.int32) if off is None else jnp.asarray(off, jnp.int32)]
    if cfg.mask_mod:
        rows, cols = (cfg.tile_n, cfg.tile_m) if backward else (cfg.tile_m, cfg.tile_n)
        table = None
        if arrays.block_mask is not None:
            n_cols = -(-(T if backward else S) // cols)
            table = mod_blocks.table_from_block_mask(arrays.block_mask, rows, cols, backward, N,
                                                     K, n_cols)
        if table is None and backward:
            table = mod_blocks.backward_table(cfg.mask_mod, aux, B, N, K, T, S, cfg.tile_m,
                                              cfg.tile_n, off)
        elif table is None:
            table = mod_blocks.forward_table(cfg.mask_mod, aux, B, N, T, S, cfg.tile_m,
                                             cfg.tile_n, off)
        ins.append(table.astype(jnp.int32))
    return ins + [jnp.asarray(x, dt) for x, (dt, _) in zip(aux, cfg.aux)]


def bwd_prepare(lse, dout, out, q_seqlen, Tp: int):
    """(lse2, delta) [B, N, Tp] float32, the backward kernel's O(T) inputs."""
    T = lse.shape[-1]
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    # Rows that saw no key have LSE -inf; rows past q_seqlen get no gradient: +inf makes
    # P = exp2(s - lse2) exactly 0 there (never NaN).
    valid = lse > -jnp.inf
    if q_seqlen is not None:
        rows = jnp.arange(T, dtype=jnp.int32)
        valid &= rows[None, None, :] < q_seqlen.astype(jnp.int32)[:, None, None]
    lse2 = jnp.where(valid, lse * jnp.float32(math.log2(math.e)), jnp.inf)
    pad = ((0, 0), (0, 0), (0, Tp - T))
    lse2 = jnp.pad(lse2.astype(jnp.float32), pad, constant_values=jnp.inf)
    return lse2, jnp.pad(delta, pad)


def bwd_finish(dq_acc, T: int, cfg, scale: float, dtype):
    """dQ [B, T, N, H] from the kernel's float32 accumulator: un-permuted (``dq_flat``),
    scaled and cast, in one XLA fusion."""
    if cfg.dq_flat:  # fragment order -> [B, T, N, H]
        dq_acc = dq_from_flat(dq_acc, T, cfg)
    return (dq_acc * jnp.float32(scale)).astype(dtype)


def backward(launch, q, k, v, arrays, statics, out, lse, dout):
    """(dq, dk, dv, None, dslopes or None) by the backward `launch`."""
    B, T, N, H = q.shape
    cfg = launch.config
    Tp = padded_len(T, cfg)
    dout = dout.astype(q.dtype)
    lse2, delta = bwd_prepare(lse, dout, out, arrays.q_seqlen, Tp)
    inputs = [q, k, v, dout, lse2, delta]
    if cfg.has_q_seqlen:
        inputs.append(arrays.q_seqlen.astype(jnp.int32))
    if cfg.has_kv_seqlen:
        inputs.append(arrays.kv_seqlen.astype(jnp.int32))
    if cfg.has_alibi:
        inputs.append(jnp.asarray(arrays.alibi_slopes, jnp.float32).reshape(1, N))
    if cfg.has_segments:
        # Block summaries with rows = keys, columns = queries (the backward's loop).
        qs = jnp.asarray(arrays.q_segment_ids, jnp.int32)
        ks = jnp.asarray(arrays.kv_segment_ids, jnp.int32)
        kv_blocks, q_blocks = block_summaries(ks, qs, cfg.tile_n, cfg.tile_m)
        inputs += [qs, ks, kv_blocks, q_blocks]
    inputs += mod_inputs(cfg, arrays, q, k, backward=True)
    fs, is_ = fwd_scalars(statics)
    out_shapes = [jax.ShapeDtypeStruct(dq_acc_shape(B, T, N, H, cfg), jnp.float32),
                  jax.ShapeDtypeStruct(k.shape, k.dtype),
                  jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if cfg.has_alibi:  # per-warp partial sums of dS_ij |i - j|
        out_shapes.append(jax.ShapeDtypeStruct(
            (B, N, num_k_blocks(k.shape[1], cfg), ALIBI_PARTS), jnp.float32))
    if cfg.deterministic:  # the kernel's ordering semaphores (scratch)
        out_shapes.append(jax.ShapeDtypeStruct((B, N, num_q_blocks(T, cfg)), jnp.int32))
    outs = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs, int_scalars=is_)
    dq_acc, dk, dv = outs[:3]
    dq = bwd_finish(dq_acc, T, cfg, statics.scale, q.dtype)
    dslopes = None
    if cfg.has_alibi:
        # The logit holds -slope * |i - j|: d(slope) = -sum dS_ij |i - j| over b, i, j.
        dslopes = -outs[3].sum(axis=(0, 2, 3))
    if statics.mods is not None:  # the aux leaves' cotangents, blockwise in XLA
        from jaxflash.mods import aux_grad
        daux = aux_grad.aux_grads(q, k, v, arrays, statics, lse, dout, delta[..., :T])
        return dq, dk, dv, None, dslopes, daux
    return dq, dk, dv, None, dslopes
