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
from jaxflash.kernels.variants import sm100_bwd_launch
from jaxflash.kernels.variants.bwd import ALIBI_PARTS
from jaxflash.kernels.variants.bwd_launch import (dq_acc_shape, dq_from_flat, num_k_blocks,
                                                  num_q_blocks, padded_len)
from jaxflash.kernels.variants.fwd_fp8_launch import fwd_fp8_inputs
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


def forward_fp8(launch, q8, k8, v8, arrays, statics):
    """(out [B, T, N, Hv] out_dtype, lse [B, N, T] float32) by the FP8 forward `launch`, with
    the canonical scales (`jaxflash._types.AttentionArrays`, [B, heads, nb]: one block, or the
    128-row blocks the plan matched to the kernel's tiles)."""
    B, T, N, _ = q8.shape
    cfg = launch.config
    descales = [getattr(arrays, n) for n in ("q_scale", "k_scale", "v_scale")]
    inputs = fwd_fp8_inputs(cfg, q8, k8, v8, *descales, q_seqlen=arrays.q_seqlen,
                            kv_seqlen=arrays.kv_seqlen, q_segment_ids=arrays.q_segment_ids,
                            kv_segment_ids=arrays.kv_segment_ids)
    fs, is_ = fwd_scalars(statics)
    out_shapes = [jax.ShapeDtypeStruct((B, T, N, v8.shape[-1]), jnp.dtype(cfg.out_dtype)),
                  jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    out, lse = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs, int_scalars=is_)
    return out, lse


def mod_inputs(cfg, arrays, q, k, backward: bool) -> list:
    """A mod variant's extra inputs: the (batch, head) offsets of a shard (zeros unsharded),
    the mask_mod's block range table (from the call's `BlockMask` where its blocks line up
    with the kernel's tiles, else computed here from the same program) and the aux leaves."""
    # (configs without mod fields, such as the Blackwell forward's, take no mod inputs)
    if not (getattr(cfg, "score_mod", "") or getattr(cfg, "mask_mod", "")):
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
        if (table is None and off is None and not mod_blocks.reads_aux(cfg.mask_mod)
                and T * S <= mod_blocks.CONSTANT_TABLE_MAX_PAIRS):
            table = jnp.asarray(mod_blocks.constant_table(cfg.mask_mod, backward, B, N, K, T,
                                                          S, cfg.tile_m, cfg.tile_n))
        if table is None and backward:
            table = mod_blocks.backward_table(cfg.mask_mod, aux, B, N, K, T, S, cfg.tile_m,
                                              cfg.tile_n, off)
        elif table is None:
            table = mod_blocks.forward_table(cfg.mask_mod, aux, B, N, T, S, cfg.tile_m,
                                             cfg.tile_n, off)
        ins.append(table.astype(jnp.int32))
    return ins + [jnp.asarray(x, dt) for x, (dt, _) in zip(aux, getattr(cfg, "aux", ()))]


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


# CUDA limits a launch grid's y and z extents to 65535; the backward's grid is (key blocks,
# kv heads, batch), so larger batches and head counts are split into several launches.
GRID_YZ_MAX = 65535


def backward(launch, q, k, v, arrays, statics, out, lse, dout):
    """(dq, dk, dv, None, dslopes or None) by the backward `launch`; batches or kv-head counts
    past the grid's y/z limit run as several launches over slices."""
    B, _, N, _ = q.shape
    K = k.shape[2]
    if max(B, K) > GRID_YZ_MAX and statics.mods is not None:
        # A mod reads the batch / head index: slices would renumber them.
        raise NotImplementedError(f"score / mask mods with batch {B} or kv heads {K} past the "
                                  f"launch grid's {GRID_YZ_MAX}: split the call")
    if B > GRID_YZ_MAX:
        parts = [backward(launch, *_batch_slice(b, b + GRID_YZ_MAX, q, k, v, arrays, out, lse,
                                                dout, statics))
                 for b in range(0, B, GRID_YZ_MAX)]
        return _join(parts, batch=True)
    if K > GRID_YZ_MAX:
        g = N // K
        parts = [backward(launch, *_head_slice(h, min(h + GRID_YZ_MAX, K), g, q, k, v, arrays,
                                               out, lse, dout, statics))
                 for h in range(0, K, GRID_YZ_MAX)]
        return _join(parts, batch=False)
    return _backward(launch, q, k, v, arrays, statics, out, lse, dout)


def _batch_slice(b0, b1, q, k, v, arrays, out, lse, dout, statics):
    per_batch = {f: getattr(arrays, f)[b0:b1] for f in
                 ("q_seqlen", "kv_seqlen", "q_segment_ids", "kv_segment_ids")
                 if getattr(arrays, f) is not None}
    return (q[b0:b1], k[b0:b1], v[b0:b1], arrays._replace(**per_batch), statics,
            out[b0:b1], lse[b0:b1], dout[b0:b1])


def _head_slice(h0, h1, g, q, k, v, arrays, out, lse, dout, statics):
    n0, n1 = h0 * g, h1 * g
    upd = {}
    if arrays.alibi_slopes is not None:
        upd["alibi_slopes"] = jnp.reshape(arrays.alibi_slopes, (-1,))[n0:n1]
    return (q[:, :, n0:n1], k[:, :, h0:h1], v[:, :, h0:h1],
            arrays._replace(**upd), statics, out[:, :, n0:n1], lse[:, n0:n1],
            dout[:, :, n0:n1])


def _join(parts, batch: bool):
    axis = 0 if batch else 2
    dq, dk, dv = (jnp.concatenate([p[i] for p in parts], axis=axis) for i in range(3))
    slopes = [p[4] for p in parts]
    if slopes[0] is None:
        dslopes = None
    elif batch:  # d(slope) sums over the batch
        dslopes = sum(slopes[1:], slopes[0])
    else:
        dslopes = jnp.concatenate(slopes)
    return dq, dk, dv, None, dslopes


def _backward_passes(launch) -> tuple:
    """The launches of a backward: one, or (the sm_100a backward at hd 256) its passes."""
    if hasattr(launch.config, "passes"):
        return sm100_bwd_launch.pass_launches(launch)
    return (launch,)


def _output_names(cfg) -> tuple[str, ...]:
    if hasattr(cfg, "passes"):
        return sm100_bwd_launch.output_names(cfg)
    return (("dq_acc", "dk", "dv") + ("alibi_parts",) * cfg.has_alibi
            + ("dq_sem",) * cfg.deterministic)


def _backward(launch, q, k, v, arrays, statics, out, lse, dout):
    B, T, N, H = q.shape
    launches = _backward_passes(launch)
    Tp = max(padded_len(T, l.config) for l in launches)
    dout = dout.astype(q.dtype)
    lse2, delta = bwd_prepare(lse, dout, out, arrays.q_seqlen, Tp)
    fs, is_ = fwd_scalars(statics)
    res = {}
    for one in launches:  # the passes of a split backward write disjoint outputs
        cfg = one.config
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
        shapes = {
            "dq_acc": jax.ShapeDtypeStruct(dq_acc_shape(B, T, N, H, cfg), jnp.float32),
            "dk": jax.ShapeDtypeStruct(k.shape, k.dtype),
            "dv": jax.ShapeDtypeStruct(v.shape, v.dtype),
            # per-warp partial sums of dS_ij |i - j|
            "alibi_parts": jax.ShapeDtypeStruct(
                (B, N, num_k_blocks(k.shape[1], cfg), ALIBI_PARTS), jnp.float32),
            # the kernel's ordering semaphores (scratch)
            "dq_sem": jax.ShapeDtypeStruct((B, N, num_q_blocks(T, cfg)), jnp.int32)}
        names = _output_names(cfg)
        outs = ffi.call(one, *inputs, out_shapes=[shapes[n] for n in names], scalars=fs,
                        int_scalars=is_)
        res.update(zip(names, outs))
        if "dq_acc" in names:
            dq_cfg = cfg
    dq_acc, dk, dv = res["dq_acc"], res["dk"], res["dv"]
    cfg = dq_cfg
    dq = bwd_finish(dq_acc, T, cfg, statics.scale, q.dtype)
    dslopes = None
    if cfg.has_alibi:
        # The logit holds -slope * |i - j|: d(slope) = -sum dS_ij |i - j| over b, i, j.
        dslopes = -res["alibi_parts"].sum(axis=(0, 2, 3))
    if statics.mods is not None:  # the aux leaves' cotangents, blockwise in XLA
        from jaxflash.mods import aux_grad
        daux = aux_grad.aux_grads(q, k, v, arrays, statics, lse, dout, delta[..., :T])
        return dq, dk, dv, None, dslopes, daux
    return dq, dk, dv, None, dslopes


# ---------------------------------------------------------------------------------------------
# FP8 backward (`FlashBwdSm90Fp8`). Before the kernel: dO in E5M2 with one amax scale per 128
# query rows (the contract's BWD_Q_TILE: `bwd_fp8.DO_SCALE_ROWS`; quantized by the caller,
# `jaxflash.fp8.prologue.quantize_rows`), and the transposed copies Q^T, dO^T, K^T the
# kernel's K-major FP8 GEMMs need, their sequence axis permuted within each 16
# (`bwd_fp8_launch.Q_ORDER` / `K_ORDER`; `variants.keys_major`).


def _per_tile(scale, block: int, tile: int, length: int):
    """Canonical scales [B, heads, nb] (one per `block` rows) -> one per kernel tile of `tile`
    rows [B, heads, ceil(length / tile)] (the plan checked that no tile straddles blocks)."""
    n = -(-length // tile)
    idx = jnp.minimum(jnp.arange(n) * tile // block, scale.shape[-1] - 1)
    return jnp.take(jnp.asarray(scale, jnp.float32), idx, axis=-1)


def backward_fp8(launch, q8, k8, v8, arrays, statics, out, lse, dout, do8, do_scale):
    """(dq, dk, dv, None, None) float32 by the FP8 backward `launch`: gradients with respect to
    the dequantized q, k, v (the contract's, `jaxflash.fp8.contract`). `do8` / `do_scale`:
    `dout` quantized by the contract's dO rule (`jaxflash.fp8.prologue.quantize_rows`, one
    scale per `bwd_fp8.DO_SCALE_ROWS` rows, ``[B, N, nb]``)."""
    from jaxflash.kernels.variants.bwd_fp8 import DO_SCALE_ROWS
    from jaxflash.kernels.variants.keys_major import keys_major
    from jaxflash.kernels.variants.bwd_fp8_launch import K_SPLIT, KEY_PAD, Q_SPLIT
    B, T, N, H = q8.shape
    S = k8.shape[1]
    cfg = launch.config
    spec = statics.fp8
    Tp = padded_len(T, cfg)
    Sp = -(-S // KEY_PAD) * KEY_PAD
    # the contract's D_i: from dO as quantized (what the kernel's dP is made of)
    do_rows = jnp.repeat(jnp.asarray(do_scale, jnp.float32), DO_SCALE_ROWS, axis=-1)[..., :T]
    do_deq = do8.astype(jnp.float32) * jnp.swapaxes(do_rows, 1, 2)[..., None]
    lse2, delta = bwd_prepare(lse, do_deq, out, arrays.q_seqlen, Tp)
    inputs = [q8, k8, v8, do8, keys_major(q8, Q_SPLIT, Tp), keys_major(k8, K_SPLIT, Sp),
              keys_major(do8, Q_SPLIT, Tp), lse2, delta]
    if cfg.has_q_seqlen:
        inputs.append(arrays.q_seqlen.astype(jnp.int32))
    if cfg.has_kv_seqlen:
        inputs.append(arrays.kv_seqlen.astype(jnp.int32))
    if cfg.has_segments:
        qs = jnp.asarray(arrays.q_segment_ids, jnp.int32)
        ks = jnp.asarray(arrays.kv_segment_ids, jnp.int32)
        kv_blocks, q_blocks = block_summaries(ks, qs, cfg.tile_n, cfg.tile_m)
        inputs += [qs, ks, kv_blocks, q_blocks]
    inputs += [_per_tile(arrays.q_scale, spec.q_block, cfg.tile_m, T),
               _per_tile(do_scale, DO_SCALE_ROWS, cfg.tile_m, T),
               _per_tile(arrays.k_scale, spec.k_block, cfg.tile_n, S),
               _per_tile(arrays.v_scale, spec.v_block, cfg.tile_n, S)]
    fs, is_ = fwd_scalars(statics)
    out_shapes = [jax.ShapeDtypeStruct(dq_acc_shape(B, T, N, H, cfg), jnp.float32),
                  jax.ShapeDtypeStruct(k8.shape, jnp.float32),
                  jax.ShapeDtypeStruct(v8.shape, jnp.float32)]
    dq_acc, dk, dv = ffi.call(launch, *inputs, out_shapes=out_shapes, scalars=fs,
                              int_scalars=is_)
    dq = bwd_finish(dq_acc, T, cfg, statics.scale, jnp.float32)
    return dq, dk, dv, None, None
