"""Our Pallas attention kernels, forward and backward (`fwd`, `bwd`), with every feature of the
canonical form in-kernel: causal/window (fully masked tiles skipped), softcap, ALiBi, segment
ids, seq lengths, GQA/MQA (K/V read per group, never repeated), dense bias/mask (size-1 batch or
head dims broadcast by the index_map), any T and S (ragged tails masked in-kernel), head dims up
to 256 (padded to a power of two inside the kernels by masked loads), Hv != H.

Custom attention (`jaxflash.mods`): the mods' jaxprs are replayed on each tile
(`mods_tile`), aux arrays passed whole; a block mask's lists choose the tiles (full ones skip
the mask_mod); the aux gradient is computed in XLA (`jaxflash.mods.aux_grad`).

Memory beyond the inputs is O(T + S) per head in both passes: out, lse, delta [B,N,T] and the
per-row ALiBi partials [B,N,T]. The one T x S sized output is dbias, in the bias's own shape.

Lowering: Pallas' Triton backend on NVIDIA GPUs; interpret mode on CPU (tests). Mosaic (TPU)
is not supported yet: see `check`.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxflash._types import GPU_PLATFORMS
from jaxflash.mods import aux_grad as _aux_grad
from jaxflash.pallas_fallback import bwd as _bwd
from jaxflash.pallas_fallback import config as _config
from jaxflash.pallas_fallback import fwd as _fwd
from jaxflash.pallas_fallback import mods_tile
from jaxflash.pallas_fallback.tiles import Spec

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535  # CUDA limit of a launch grid's y and z extents


def check(problem):
    """Raise NotImplementedError(reason) for calls these kernels cannot serve."""
    p = problem
    if p.platform not in GPU_PLATFORMS + ("cpu",):
        raise NotImplementedError(
            f"the Pallas kernels lower through Triton (NVIDIA GPUs) or run in interpret mode "
            f"(CPU); platform {p.platform!r} is not supported (they use masked loads for "
            f"ragged tails, which Mosaic/TPU and ROCm are not verified with)")
    if p.mods is not None:
        mods_tile.check(p.mods)
    for name, d in (("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v)):
        if d > _config.MAX_HEAD_DIM:
            raise NotImplementedError(f"{name} {d} > {_config.MAX_HEAD_DIM}: the tiles would "
                                      f"not fit in shared memory")
    per_head = _per_head_elements(p.q_len, p.kv_len, p.num_heads // p.num_kv_heads,
                                  max(p.head_dim, p.head_dim_v),
                                  p.bias_shape is not None or p.has_mask)
    if per_head > _INT32_MAX:
        raise NotImplementedError(
            f"one kv head of one batch element spans {per_head} elements; the Triton kernels "
            f"index with int32 (limit {_INT32_MAX}), and larger calls are split only by batch "
            f"and kv head")


def _per_head_elements(T, S, G, H, dense) -> int:
    """Elements of the largest operand slice one (batch element, kv head) contributes: the
    unit the calls are split by (see `_pieces`)."""
    return max(T * G * H, S * H, G * T * S if dense else 0)


def _pieces(q, k, v, arrays):
    """(b0, b1, h0, h1) slices over batch and kv heads, each a separate kernel launch whose
    operands stay within int32 indexing and whose grid stays within the 65535 limit of the
    y / z launch dimensions (the Triton grid is (query blocks, batch, heads)). One piece, the
    whole call, when it fits."""
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K
    dense = arrays.bias is not None or arrays.mask is not None
    per_head = _per_head_elements(T, S, G, max(H, Hv), dense)
    heads = max(1, min(K, _INT32_MAX // per_head, _GRID_YZ_MAX // G))
    batch = max(1, min(B, _GRID_YZ_MAX, _INT32_MAX // (per_head * K))) if heads == K else 1
    return [(b, min(b + batch, B), h, min(h + heads, K))
            for b in range(0, B, batch) for h in range(0, K, heads)]


def _slice(x, b0, b1, n0, n1, *, full_b, full_n):
    """`x` restricted to batch [b0, b1) and heads [n0, n1) along dims 0 and 1 where they are
    not broadcast (size 1)."""
    if x.shape[0] == full_b and full_b > 1:
        x = x[b0:b1]
    if x.ndim > 1 and x.shape[1] == full_n and full_n > 1:
        x = x[:, n0:n1]
    return x


def _piece_inputs(q, k, v, arrays, piece):
    b0, b1, h0, h1 = piece
    B, _, N, _ = q.shape
    G = N // k.shape[2]
    n0, n1 = h0 * G, h1 * G
    upd = {f: getattr(arrays, f)[b0:b1] for f in
           ("q_seqlen", "kv_seqlen", "q_segment_ids", "kv_segment_ids")
           if getattr(arrays, f) is not None}
    for f in ("bias", "mask"):
        if getattr(arrays, f) is not None:
            upd[f] = _slice(getattr(arrays, f), b0, b1, n0, n1, full_b=B, full_n=N)
    if arrays.alibi_slopes is not None:
        upd["alibi_slopes"] = arrays.alibi_slopes[n0:n1]
    return (q[b0:b1, :, n0:n1], k[b0:b1, :, h0:h1], v[b0:b1, :, h0:h1],
            arrays._replace(**upd), (b0, b1, n0, n1))


def _join(parts, pieces, axis_b, axis_n):
    """Reassemble per-piece results (batch-major piece order) along the given axes."""
    rows, row, last_b = [], [], None
    for part, (b0, _, _, _) in zip(parts, pieces):
        if last_b is not None and b0 != last_b:
            rows.append(row)
            row = []
        row.append(part)
        last_b = b0
    rows.append(row)
    cat = lambda xs, ax: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=ax)
    return cat([cat(r, axis_n) for r in rows], axis_b)


def _spec(q, k, v, arrays, statics) -> Spec:
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    window = statics.window
    if window is not None:  # beyond T + S a window bound changes nothing; keep int32 math safe
        window = (min(window[0], T + S), min(window[1], T + S))
    bias, mask = arrays.bias, arrays.mask
    bm = arrays.block_mask
    return Spec(
        T=T, S=S, H=H, Hv=Hv, Hp=_config.padded_head_dim(H),
        Hvp=_config.padded_head_dim(Hv), G=N // K, scale=float(statics.scale),
        is_causal=statics.is_causal, window=window, softcap=statics.softcap,
        has_alibi=arrays.alibi_slopes is not None, has_bias=bias is not None,
        has_mask=mask is not None, has_seg=arrays.q_segment_ids is not None,
        has_qlen=arrays.q_seqlen is not None, has_kvlen=arrays.kv_seqlen is not None,
        bias_b=bias is not None and bias.shape[0] != 1,
        bias_n=bias is not None and bias.shape[1] != 1,
        mask_b=mask is not None and mask.shape[0] != 1,
        mask_n=mask is not None and mask.shape[1] != 1,
        mods=statics.mods, n_aux=len(arrays.mod_aux),
        mod_offsets=arrays.mod_offsets is not None,
        sparse=None if bm is None else tuple(bm.block),
        bm_b=bm is not None and bm.batch_heads[0] != 1,
        bm_n=bm is not None and bm.batch_heads[1] != 1)


def _operands(arrays, spec: Spec) -> dict:
    """The optional arrays in kernel form. Seq lengths are clipped to [0, T] / [0, S] (same
    mask, and the block-skipping arithmetic stays in range); the bool mask travels as int8
    (Triton has no i1 memory type)."""
    ops = {}
    if arrays.bias is not None:
        ops["bias"] = arrays.bias
    if arrays.mask is not None:
        ops["mask"] = arrays.mask.astype(jnp.int8)
    if arrays.q_segment_ids is not None:
        ops["q_seg"] = arrays.q_segment_ids
        ops["kv_seg"] = arrays.kv_segment_ids
    if arrays.q_seqlen is not None:
        ops["q_len"] = jnp.clip(arrays.q_seqlen, 0, spec.T).astype(jnp.int32)
    if arrays.kv_seqlen is not None:
        ops["kv_len"] = jnp.clip(arrays.kv_seqlen, 0, spec.S).astype(jnp.int32)
    if arrays.alibi_slopes is not None:
        ops["alibi"] = arrays.alibi_slopes.astype(jnp.float32)
    if arrays.mod_offsets is not None:
        ops["mod_off"] = arrays.mod_offsets.astype(jnp.int32)
    for i, x in enumerate(arrays.mod_aux):
        ops[f"aux{i}"] = x.reshape(1) if x.ndim == 0 else x
    bm = arrays.block_mask
    if bm is not None:
        for pre, (fc, fi, pc, pi) in (("bm_", (bm.full_count, bm.full_idx, bm.partial_count,
                                               bm.partial_idx)),
                                      ("bmt_", (bm.full_count_t, bm.full_idx_t,
                                                bm.partial_count_t, bm.partial_idx_t))):
            ops.update({pre + "fc": fc, pre + "fi": fi, pre + "pc": pc, pre + "pi": pi})
    return ops


def _compiler_params(pc, interpret):
    """Triton launch parameters on GPUs; None elsewhere (interpret ignores them, and writing
    Triton's class into a TPU call would be wrong). The class is `CompilerParams` in the jax
    versions we support (0.10, 0.11); older releases named it `TritonCompilerParams`."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=pc.num_warps, num_stages=pc.num_stages)


# Shared memory per (query, key) element that Triton's layout conversions take for a score
# mod reading a table per element (aux of rank >= 2, e.g. T5's bias table): three 32-bit
# tiles (with the kernel's tiles halved that leaves room for what Triton asked for).
# The stream estimate does not see them; on an H200 T5 + window + softcap at D = 64 asked for
# 240 KB of the 227 KB there are without this reserve.
_MOD_TABLE_SCRATCH_BYTES = 12


def _choose(q, arrays, spec, interpret, mods=None):
    """The tuned tiles, shrunk to the GPU's shared memory given the dense operands streamed
    per tile (bias in its dtype, mask as int8) and a table-reading score mod's scratch. Under a
    block mask the forward, dQ and dK / dV tiles are at most its blocks (powers of two both,
    so each mask tile is whole kernel blocks: the lists index mask tiles, the kernels walk
    their blocks)."""
    dense = (0 if arrays.bias is None else jnp.dtype(arrays.bias.dtype).itemsize) + (
        0 if arrays.mask is None else 1)
    if mods is not None and mods.has_score and any(len(s) >= 2 for s, _ in mods.aux_avals):
        dense += _MOD_TABLE_SCRATCH_BYTES
    cfg = _config.choose(spec.H, spec.Hv, str(q.dtype), interpret=interpret,
                         dense_bytes=dense)
    if arrays.block_mask is not None:
        tm, tn = arrays.block_mask.block
        cfg = _config.within_blocks(cfg, tm, tn)
    return cfg


def forward(q, k, v, arrays, statics, *, interpret=False, config=None):
    """(out [B,T,N,Hv] q.dtype, lse [B,N,T] float32). `config` overrides the tuned table."""
    pieces = _pieces(q, k, v, arrays)
    if len(pieces) > 1 and statics.mods is not None:
        # A mod reads the batch / head index: slices would renumber them.
        raise NotImplementedError("score / mask mods on a call too large for one launch "
                                  "(past int32 indexing or the 65535 grid limit)")
    if len(pieces) > 1:
        parts = [_forward(*_piece_inputs(q, k, v, arrays, p)[:4], statics, interpret, config)
                 for p in pieces]
        return (_join([o for o, _ in parts], pieces, 0, 2),
                _join([l for _, l in parts], pieces, 0, 1))
    return _forward(q, k, v, arrays, statics, interpret, config)


def _forward(q, k, v, arrays, statics, interpret, config):
    spec = _spec(q, k, v, arrays, statics)
    cfg = config or _choose(q, arrays, spec, interpret, statics.mods)
    return _fwd.forward(q, k, v, _operands(arrays, spec), spec, cfg.fwd, interpret=interpret,
                        compiler_params=_compiler_params(cfg.fwd, interpret))


def backward(q, k, v, arrays, statics, out, lse, dout, *, interpret=False, config=None):
    """(dq, dk, dv, dbias or None, dalibi [N] or None)."""
    pieces = _pieces(q, k, v, arrays)
    if len(pieces) > 1 and statics.mods is not None:
        # A mod reads the batch / head index: slices would renumber them.
        raise NotImplementedError("score / mask mods on a call too large for one launch "
                                  "(past int32 indexing or the 65535 grid limit)")
    if len(pieces) == 1:
        return _backward(q, k, v, arrays, statics, out, lse, dout, interpret, config)
    parts = []
    for p in pieces:
        pq, pk, pv, pa, (b0, b1, n0, n1) = _piece_inputs(q, k, v, arrays, p)
        parts.append(_backward(pq, pk, pv, pa, statics, out[b0:b1, :, n0:n1],
                               lse[b0:b1, n0:n1], dout[b0:b1, :, n0:n1], interpret, config))
    dq, dk, dv = (_join([r[i] for r in parts], pieces, 0, 2) for i in range(3))
    dbias = None
    if arrays.bias is not None:
        dbias = _join_reduced([r[3] for r in parts], pieces, arrays.bias.shape, q.shape)
    dalibi = None
    if arrays.alibi_slopes is not None:  # [N]: heads concatenated, batch pieces summed
        dalibi = _join_reduced([r[4][None] for r in parts], pieces, (1, q.shape[2]),
                               q.shape)[0]
    return dq, dk, dv, dbias, dalibi


def _join_reduced(parts, pieces, shape, qshape):
    """Join per-piece gradients of an operand with dims (batch, heads, ...) that may be
    broadcast (size 1): concatenated along real dims, summed over broadcast ones."""
    B, N = qshape[0], qshape[2]
    acc = {}
    for part, (b0, b1, h0, h1) in zip(parts, pieces):
        key = (b0 if shape[0] == B and B > 1 else 0, h0 if shape[1] == N and N > 1 else 0)
        acc[key] = part if key not in acc else acc[key] + part
    bkeys = sorted({k[0] for k in acc})
    hkeys = sorted({k[1] for k in acc})
    rows = [jnp.concatenate([acc[(b, h)] for h in hkeys], axis=1) if len(hkeys) > 1
            else acc[(b, hkeys[0])] for b in bkeys]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


def _backward(q, k, v, arrays, statics, out, lse, dout, interpret, config):
    spec = _spec(q, k, v, arrays, statics)
    cfg = config or _choose(q, arrays, spec, interpret, statics.mods)
    ops = _operands(arrays, spec)
    dout = dout.astype(q.dtype)
    # delta = rowsum(dO * O): see bwd's docstring for why this is plain XLA.
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    kw = dict(interpret=interpret)
    dk, dv = _bwd.dkdv(q, k, v, dout, lse, delta, ops, spec, cfg.dkdv,
                       compiler_params=_compiler_params(cfg.dkdv, interpret), **kw)
    dq, dal_rows = _bwd.dq(q, k, v, dout, lse, delta, ops, spec, cfg.dq,
                           compiler_params=_compiler_params(cfg.dq, interpret), **kw)
    dbias = None
    if arrays.bias is not None:
        dbias = _bwd.dbias(q, k, v, dout, lse, delta, ops, spec, cfg.dbias,
                           compiler_params=_compiler_params(cfg.dbias, interpret), **kw)
    dalibi = None if dal_rows is None else jnp.sum(dal_rows, axis=(0, 2))
    if statics.mods is None:
        return dq, dk, dv, dbias, dalibi
    # The aux gradient is XLA's, blockwise over query rows (see jaxflash.mods.aux_grad).
    daux = _aux_grad.aux_grads(q, k, v, arrays, statics, lse, dout, delta)
    return dq, dk, dv, dbias, dalibi, daux
