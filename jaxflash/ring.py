"""Ring attention: sequence (context) parallelism over one mesh axis.

q, k, v are sharded along the sequence over ``seq_axis`` (P devices). Each device keeps its query
block and passes key/value blocks around the ring with `lax.ppermute`; every step computes one
(query block, key block) attention through a backend's own ``forward`` (so the Pallas / CuTe
kernels do the work) and merges it into the running result through the blocks' LSE. The next
block's transfer does not depend on the current step's compute, so XLA overlaps the two.

The backward is a ring too (`jax.custom_vjp`): K/V travel again, each together with the
gradient accumulators dK/dV of its block, which arrive back at their owner after the last step.
Each step calls the backend's ``backward`` with the GLOBAL (merged) out and LSE: with the global
LSE the block's softmax probabilities are exactly the global ones, so a flash backward of one
block is exactly that block's share of the gradient.

Layouts of the sequence dim (what the caller passes, and gets back):

- ``"contiguous"``: device d holds positions ``[d L, (d+1) L)`` (plain sequence sharding). With a
  causal mask the work is unbalanced: device d computes d + 1 of the P blocks, the rest are
  skipped (so the step time is set by the last device).
- ``"zigzag"``: the sequence is cut into 2P chunks and device d holds chunks d and 2P-1-d (load
  balanced for causal masks: every device computes the same amount in every step, half of a
  full block per step after the first). Bring arrays into this order with `to_zigzag` (and
  back with `from_zigzag`); for a model, permute the token ids / positions once at the input
  (free) rather than the activations per layer. Doing it here instead would cost one
  all-to-all of q, k, v and of the output per call.

Masks follow `jaxflash.flash_attention` (global positions): causal, key/query sequence lengths
and segment ids. Fully masked blocks (by causality) are skipped, not computed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxflash import _vma, api, dispatch, precision as prec, quantize
from jaxflash._types import AttentionArrays, AttentionStatics, Problem, accum_dtype
from jaxflash.backends.base import Backend
from jaxflash.fp8 import layout as fp8_layout, prologue

LAYOUTS = ("contiguous", "zigzag")


def _zigzag_chunks(x, num_shards: int, axis: int):
    """`x` cut into 2P chunks along `axis`, and the zigzag order of chunk indices."""
    n = 2 * num_shards
    if x.shape[axis] % n:
        raise ValueError(f"zigzag needs the sequence length ({x.shape[axis]}) to be a multiple "
                         f"of 2 x {num_shards} shards; got shape {x.shape}")
    return jnp.split(x, n, axis=axis), [c for d in range(num_shards) for c in (d, n - 1 - d)]


def to_zigzag(x, num_shards: int, axis: int = 1):
    """Reorder the sequence `axis` of `x` (natural order) into the zigzag layout for
    `num_shards` devices: chunks ``0, 2P-1, 1, 2P-2, ...`` (device d's two chunks adjacent)."""
    chunks, order = _zigzag_chunks(x, num_shards, axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
    """Inverse of `to_zigzag`."""
    chunks, order = _zigzag_chunks(x, num_shards, axis)
    back = [None] * len(chunks)
    for pos, c in enumerate(order):
        back[c] = chunks[pos]
    return jnp.concatenate(back, axis=axis)


def ring_attention(query, key, value, *, mesh, seq_axis: str, batch_axis=None, head_axis=None,
                   layout: str = "contiguous", scale: Optional[float] = None,
                   is_causal: bool = False, softcap: Optional[float] = None,
                   query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
                   kv_segment_ids=None, implementation: Optional[str] = None,
                   return_residual: bool = False, precision: Optional[str] = None,
                   q_scale=None, k_scale=None, v_scale=None, out_dtype=None,
                   hadamard: Optional[bool] = None, hadamard_seed=None, scale_block: int = 128,
                   dout_dtype=None):
    """Self-attention with the sequence sharded over ``mesh`` axis ``seq_axis`` (ring).

    query ``[B, T, N, H]``, key ``[B, T, K, H]``, value ``[B, T, K, Hv]`` (one batch dim; T the
    same for all three), in the sequence `layout` described in the module docstring, are
    sharded as ``P(batch_axis, seq_axis, head_axis, None)`` (`batch_axis` / `head_axis` are
    optional further mesh axes: batch rows and kv head groups are independent, so they just
    split the work). Segment ids ``[B, T]`` shard like the sequence; sequence lengths ``[B]``
    count global positions in natural order. Semantics and the other arguments are those of
    `jaxflash.flash_attention`. Returns the output (and with `return_residual` the LSE
    ``[B, T, N]``, gradient stopped) in the same layout and sharding.

    Runs inside `jax.shard_map` over the whole mesh; call it under `jax.jit`. With
    ``mesh=None`` it is called from inside the caller's own `jax.shard_map` instead: q, k, v
    (and segment ids) are then this device's blocks along `seq_axis` (in `layout` order), and
    sequence lengths are still global.

    FP8 as in `jaxflash.flash_attention`: FP8 query / key / value with ``q_scale`` /
    ``k_scale`` / ``v_scale`` (per tensor or per (batch, head): replicated over the ring; per
    block of ``scale_block`` rows: sharded with the sequence, in the arrays' layout order, a
    device's blocks within its own chunks), or ``precision="fp8"`` (Hadamard on Q and K, then
    per-block quantization of each device's blocks). Key / value scales travel with their
    blocks. Scale blocks must not straddle a chunk (``scale_block`` divides the chunk length).
    """
    if precision == "fp4":
        raise NotImplementedError("precision='fp4' has no ring attention (jaxflash.fp4 is "
                                  "single-device)")
    req = prec.fp8_request(query, key, value, precision=precision, q_scale=q_scale,
                           k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
                           hadamard=hadamard, hadamard_seed=hadamard_seed,
                           scale_block=scale_block, emulate=False,
                           implementation=implementation, dout_dtype=dout_dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    query, q_scale, scale = api.fold_traced_scale(scale, query, q_scale, req)
    shapes = (f"query {jnp.shape(query)}, key {jnp.shape(key)}, value {jnp.shape(value)}")
    if not all(jnp.ndim(x) == 4 for x in (query, key, value)):
        raise ValueError(f"ring_attention takes [B, T, N, H] arrays (one batch dim); got {shapes}")
    q, k, v, arrays, statics, _ = api._prepare(
        query, key, value, None, None, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=None, softcap=softcap, alibi_slopes=None, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, implementation=implementation, deterministic=False,
        allow_fp8=req is not None and req.spec.source == "fp8")
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    if S != T:
        raise ValueError(f"ring_attention is self-attention: query and key sequence lengths "
                         f"must match; got {shapes}")
    if mesh is None:  # already inside a shard_map: the arrays are this device's blocks
        if batch_axis is not None or head_axis is not None:
            raise ValueError("batch_axis / head_axis are for the mesh form; inside a shard_map "
                             "the caller's specs already split batch and heads")
        try:
            nseq = int(lax.axis_size(seq_axis))
        except (NameError, ValueError, KeyError) as e:
            raise ValueError(f"mesh=None needs a call inside jax.shard_map over seq_axis="
                             f"{seq_axis!r} ({e})") from None
        mesh_shape = {seq_axis: nseq}
        T_global = T * nseq
    else:
        names = mesh.axis_names
        for name, ax in (("seq_axis", seq_axis), ("batch_axis", batch_axis),
                         ("head_axis", head_axis)):
            if ax is not None and ax not in names:
                raise ValueError(f"{name}={ax!r} is not an axis of the mesh {dict(mesh.shape)}")
        used = [a for a in (seq_axis, batch_axis, head_axis) if a is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"seq_axis, batch_axis and head_axis must differ; got {used}")
        mesh_shape = dict(mesh.shape)
        nseq = mesh_shape[seq_axis]
        T_global = T
    per = 2 * nseq if layout == "zigzag" else nseq
    if T_global % per:
        raise ValueError(f"sequence length {T_global} must be a multiple of {per} ({layout} "
                         f"layout over {nseq} devices on {seq_axis!r}); got {shapes}")
    if batch_axis is not None and B % mesh_shape[batch_axis]:
        raise ValueError(f"batch {B} is not divisible by mesh axis {batch_axis!r} of size "
                         f"{mesh_shape[batch_axis]}; got {shapes}")
    if head_axis is not None and K % mesh_shape[head_axis]:
        raise ValueError(f"key/value heads {K} are not divisible by mesh axis {head_axis!r} of "
                         f"size {mesh_shape[head_axis]} (query heads shard with their kv head); "
                         f"got {shapes}")

    platform = dispatch.current_platform()
    L = T_global // nseq
    scales, scale_specs = None, None
    if req is not None:
        statics, scales, scale_specs = _fp8_setup(req, statics, q, k, L, layout, nseq, mesh,
                                                  q_scale, k_scale, v_scale, batch_axis,
                                                  head_axis, seq_axis, shapes)
        if req.spec.source == "quantized" and req.spec.hadamard:
            # the prologue's transform: saturating, as flash_attention's (autodiff takes its
            # gradient, 0 only at saturated entries)
            signs = quantize.hadamard_signs(req.hadamard_seed, q.shape[-1])
            q = quantize.hadamard_signed(q, signs)
            k = quantize.hadamard_signed(k, signs)
    nh = lambda n: n // (mesh_shape[head_axis] if head_axis else 1)
    nb = B // (mesh_shape[batch_axis] if batch_axis else 1)
    # The backend is chosen once, for the first step's (largest) block problem; every other
    # block problem is the same but smaller or non-causal.
    probe = Problem(batch=nb, q_len=L, kv_len=L, num_heads=nh(N), num_kv_heads=nh(K),
                    head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                    dtype=statics.fp8.q_dtype if statics.fp8 else str(q.dtype),
                    statics=statics, has_q_seqlen=arrays.q_seqlen is not None,
                    has_kv_seqlen=arrays.kv_seqlen is not None,
                    has_segments=arrays.q_segment_ids is not None, platform=platform)
    backend, _ = dispatch.select(probe, implementation)
    cfg = _Ring(axis=seq_axis, size=nseq, zigzag=layout == "zigzag", backend=backend,
                statics=statics, platform=platform,
                quantize=req is not None and req.spec.source == "quantized")

    extras = (arrays.q_seqlen, arrays.kv_seqlen, arrays.q_segment_ids, arrays.kv_segment_ids)
    if mesh is None:
        out, lse = _ring(cfg, q, k, v, extras, scales)
        return out if not return_residual else (out, lax.stop_gradient(jnp.swapaxes(lse, 1, 2)))
    spec4 = P(batch_axis, seq_axis, head_axis, None)
    ext_specs = (P(batch_axis), P(batch_axis), P(batch_axis, seq_axis), P(batch_axis, seq_axis))
    # Only the operands present cross the shard_map: jax 0.11 turns a None operand into an
    # empty int32 array there, and XLA's Shardy pass then crashes on the zero-sized operand.
    present = tuple(x is not None for x in extras)

    def body(q, k, v, given, *sc):
        it = iter(given)
        return _ring(cfg, q, k, v, tuple(next(it) if p else None for p in present),
                     sc[0] if sc else None)

    sc_args = () if scales is None else (scales,)
    sc_specs = () if scales is None else (scale_specs,)
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(spec4, spec4, spec4,
                                 tuple(s for s, p in zip(ext_specs, present) if p)) + sc_specs,
                       out_specs=(spec4, P(batch_axis, head_axis, seq_axis)), check_vma=False)
    args = (q, k, v, tuple(x for x in extras if x is not None)) + sc_args
    if _vma.explicit_axes(mesh):
        # Explicit axes: shard_map takes operands typed exactly as its specs, so they are
        # resharded to them (global lengths left replicated, say), as an Auto mesh does.
        specs = (spec4, spec4, spec4, tuple(s for s, p in zip(ext_specs, present) if p))
        specs += sc_specs
        args = jax.tree.map(lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)),
                            args, specs)
    out, lse = fn(*args)
    if not return_residual:
        return out
    return out, lax.stop_gradient(jnp.swapaxes(lse, 1, 2))


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    size: int
    zigzag: bool
    backend: Backend
    statics: AttentionStatics
    platform: str
    quantize: bool = False  # precision="fp8": quantize each device's float blocks here

    @property
    def perm(self):
        return [(j, (j + 1) % self.size) for j in range(self.size)]

    def chunks(self, dev):
        """Global chunk indices a device holds, in local order."""
        return (dev, 2 * self.size - 1 - dev) if self.zigzag else (dev,)


# A step's work: which part of the local queries meets which part of the visiting keys.
# q "all" | "second" (second chunk); kv "all" | "first" (first chunk); None = skip.
@dataclasses.dataclass(frozen=True)
class _Case:
    q: str
    kv: str
    causal: bool


_FULL = _Case("all", "all", False)


def _cases(cfg: _Ring, step: int):
    """(case when my index >= step, case otherwise) for a step; the same case twice when it does
    not depend on the device. Key block of step s comes from device (i - s) mod P, which is
    below i exactly when i >= s."""
    if not cfg.statics.is_causal:
        return _FULL, _FULL
    if step == 0:
        diag = _Case("all", "all", True)  # own block: causal (also across the zigzag chunks)
        return diag, diag
    if cfg.zigzag:
        # Earlier source: both my chunks see all of its first chunk and none of its second.
        # Later source: only my second chunk sees it, all of it.
        return _Case("all", "first", False), _Case("second", "all", False)
    return _FULL, None


def _prefix_len(total, chunk_ids, C):
    """Visible length of a slice made of whole chunks (increasing global order) under a
    global length mask: the visible part is a prefix of the slice."""
    if total is None:
        return None
    return sum(jnp.clip(total - c * C, 0, C) for c in chunk_ids).astype(jnp.int32)


def _slices(cfg: _Ring, case: _Case, me, src, L, q_len, kv_len, q_seg, kv_seg):
    """(q slice, kv slice) as python slices + the block's AttentionArrays."""
    C = L // 2 if cfg.zigzag else L
    mine, theirs = cfg.chunks(me), cfg.chunks(src)
    qs = slice(C, L) if case.q == "second" else slice(0, L)
    ks = slice(0, C) if case.kv == "first" else slice(0, L)
    qc = mine[1:] if case.q == "second" else mine
    kc = theirs[:1] if case.kv == "first" else theirs
    arrays = AttentionArrays(
        q_seqlen=_prefix_len(q_len, qc, C), kv_seqlen=_prefix_len(kv_len, kc, C),
        q_segment_ids=None if q_seg is None else q_seg[:, qs],
        kv_segment_ids=None if kv_seg is None else kv_seg[:, ks])
    return qs, ks, arrays


def _block_plan(cfg, case, q, k, v, arrays):
    """The statics and plan of one ring step's block call, by the ring's backend."""
    statics = dataclasses.replace(cfg.statics, is_causal=case.causal)
    problem = Problem.from_arrays(q, k, v, arrays, statics, cfg.platform)
    _, plan = dispatch.select(problem, cfg.backend.name)
    return statics, plan


# Static-slice reads/writes. (Not `x.at[...]`: under jax 0.11 its empty index constants become
# zero-sized operands of the shard_map, on which XLA's Shardy pass crashes.)
def _get(x, axis, sl: slice):
    return lax.slice_in_dim(x, sl.start, sl.stop, axis=axis)


def _put(x, axis, sl: slice, y):
    if sl.start == 0 and sl.stop == x.shape[axis]:
        return y.astype(x.dtype)
    return lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), sl.start, axis)


def _merge(out, lse, out_b, lse_b):
    """Combine two partial softmax results through their LSE (rows with -inf stay empty)."""
    m = jnp.maximum(lse, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a, b = jnp.exp(lse - m_safe), jnp.exp(lse_b - m_safe)
    tot = a + b
    new_lse = jnp.where(tot > 0, m_safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    inv = jnp.where(tot > 0, 1.0 / jnp.where(tot > 0, tot, 1.0), 0.0)
    wa = jnp.swapaxes(a * inv, 1, 2)[..., None]
    wb = jnp.swapaxes(b * inv, 1, 2)[..., None]
    return out * wa + out_b.astype(out.dtype) * wb, new_lse


def _fp8_arrays(cfg, arrays, scales, qs, ks):
    """The block call's arrays with its slices of the FP8 scales (None for float calls)."""
    if scales is None:
        return arrays
    sp = cfg.statics.fp8
    q_s, k_s, v_s = scales
    return arrays._replace(q_scale=_scale_slice(q_s, qs, sp.q_block),
                           k_scale=_scale_slice(k_s, ks, sp.k_block),
                           v_scale=_scale_slice(v_s, ks, sp.v_block))


def _scale_slice(s, sl: slice, block: int):
    """The blocks of canonical scale `s` [B, h, nb] that rows `sl` read (one block: all)."""
    if s.shape[-1] == 1:
        return s
    return lax.slice_in_dim(s, sl.start // block, -(-sl.stop // block), axis=2)


def _forward(cfg: _Ring, q, k, v, extras, scales=None):
    q_len, kv_len, q_seg, kv_seg = extras
    B, L, N, _ = q.shape
    Hv = v.shape[-1]
    me = lax.axis_index(cfg.axis)
    acc = accum_dtype(q.dtype)
    out = jnp.zeros((B, L, N, Hv), acc)
    lse = jnp.full((B, N, L), -jnp.inf, acc)
    kv_sc = None if scales is None else scales[1:]

    for step in range(cfg.size):
        src = (me - step) % cfg.size

        def run(case, out, lse, k=k, v=v, kv_seg=kv_seg, src=src, kv_sc=kv_sc):
            if case is None:
                return out, lse
            qs, ks, arrays = _slices(cfg, case, me, src, L, q_len, kv_len, q_seg, kv_seg)
            arrays = _fp8_arrays(cfg, arrays, None if scales is None else
                                 (scales[0],) + kv_sc, qs, ks)
            qb, kb, vb = q[:, qs], k[:, ks], v[:, ks]
            statics, plan = _block_plan(cfg, case, qb, kb, vb, arrays)
            out_b, lse_b = cfg.backend.forward(qb, kb, vb, arrays, statics, plan)
            o, l = _merge(_get(out, 1, qs), _get(lse, 2, qs), out_b, lse_b)
            return _put(out, 1, qs, o), _put(lse, 2, qs, l)

        hi, lo = _cases(cfg, step)
        if hi == lo:
            out, lse = run(hi, out, lse)
        else:
            out, lse = lax.cond(me >= step, functools.partial(run, hi),
                                functools.partial(run, lo), out, lse)
        if step + 1 < cfg.size:  # pass the key/value block on (overlaps the next compute)
            k, v, kv_seg, kv_sc = lax.ppermute((k, v, kv_seg, kv_sc), cfg.axis, cfg.perm)
    odt = cfg.statics.fp8.out_dtype if cfg.statics.fp8 else q.dtype
    return out.astype(odt), lse


def _backward(cfg: _Ring, q, k, v, extras, out, lse, dout, scales=None):
    q_len, kv_len, q_seg, kv_seg = extras
    L = q.shape[1]
    me = lax.axis_index(cfg.axis)
    acc = accum_dtype(q.dtype)
    up = lambda x: x.astype(acc)
    dq = jnp.zeros(q.shape, acc)
    dk = jnp.zeros(k.shape, acc)
    dv = jnp.zeros(v.shape, acc)
    kv_sc = None if scales is None else scales[1:]

    for step in range(cfg.size):
        src = (me - step) % cfg.size

        def run(case, dq, dk, dv, k=k, v=v, kv_seg=kv_seg, src=src, kv_sc=kv_sc):
            if case is None:
                return dq, dk, dv
            qs, ks, arrays = _slices(cfg, case, me, src, L, q_len, kv_len, q_seg, kv_seg)
            arrays = _fp8_arrays(cfg, arrays, None if scales is None else
                                 (scales[0],) + kv_sc, qs, ks)
            qb, kb, vb = q[:, qs], k[:, ks], v[:, ks]
            statics, plan = _block_plan(cfg, case, qb, kb, vb, arrays)
            gq, gk, gv, _, _ = cfg.backend.backward(qb, kb, vb, arrays, statics, plan,
                                                    out[:, qs], lse[..., qs], dout[:, qs])
            return (_put(dq, 1, qs, _get(dq, 1, qs) + up(gq)),
                    _put(dk, 1, ks, _get(dk, 1, ks) + up(gk)),
                    _put(dv, 1, ks, _get(dv, 1, ks) + up(gv)))

        hi, lo = _cases(cfg, step)
        if hi == lo:
            dq, dk, dv = run(hi, dq, dk, dv)
        else:
            dq, dk, dv = lax.cond(me >= step, functools.partial(run, hi),
                                  functools.partial(run, lo), dq, dk, dv)
        # dK/dV travel with their block; after the last step they are one hop from home.
        if step + 1 < cfg.size:
            k, v, kv_seg, kv_sc, dk, dv = lax.ppermute((k, v, kv_seg, kv_sc, dk, dv), cfg.axis,
                                                       cfg.perm)
        else:
            dk, dv = lax.ppermute((dk, dv), cfg.axis, cfg.perm)
    if scales is not None:  # float32 gradients w.r.t. the dequantized operands
        return dq, dk, dv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, extras, scales):
    return _ring_fwd(cfg, q, k, v, extras, scales)[0]


def _quantized(cfg, q, k, v, extras, scales):
    """(q, k, v, scales) the ring computes on: precision="fp8" quantizes this device's blocks
    (the rows past the sequence lengths zeroed first, as `jaxflash.flash_attention` does)."""
    if not cfg.quantize:
        return q, k, v, scales
    sp = cfg.statics.fp8
    q_len, kv_len = extras[0], extras[1]
    if q_len is not None or kv_len is not None:
        L = q.shape[1]
        C = L // 2 if cfg.zigzag else L
        me = lax.axis_index(cfg.axis)
        pos = jnp.concatenate([c * C + jnp.arange(C, dtype=jnp.int32) for c in cfg.chunks(me)])
        q = prologue.zero_past_length(q, q_len, pos)
        k = prologue.zero_past_length(k, kv_len, pos)
        v = prologue.zero_past_length(v, kv_len, pos)
    qz = lambda x, dt, block: prologue.quantize_operand(x, dt, "block", block,
                                                         platform=cfg.platform)
    q8, qs = qz(q, sp.q_dtype, sp.q_block)
    k8, ks = qz(k, sp.k_dtype, sp.k_block)
    v8, vs = qz(v, sp.v_dtype, sp.v_block)
    return q8, k8, v8, (qs, ks, vs)


def _ring_fwd(cfg, q, k, v, extras, scales):
    q8, k8, v8, sc = _quantized(cfg, q, k, v, extras, scales)
    out, lse = _forward(cfg, q8, k8, v8, extras, sc)
    zero = lambda x: jnp.zeros((), x.dtype)
    return (out, lse), (q8, k8, v8, extras, sc, out, lse, (zero(q), zero(k), zero(v)))


def _ring_bwd(cfg, res, cts):
    q, k, v, extras, sc, out, lse, dts = res
    dout, _ = cts  # LSE carries no gradient (as in jaxflash.flash_attention)
    dq, dk, dv = _backward(cfg, q, k, v, extras, out, lse, dout, sc)
    none = tuple(None for _ in extras)
    if sc is None:
        return dq, dk, dv, none, None
    if cfg.quantize:  # straight-through to the float inputs
        return dq.astype(dts[0].dtype), dk.astype(dts[1].dtype), dv.astype(dts[2].dtype), none, None
    sp = cfg.statics.fp8
    dq8, dqs = fp8_layout.fp8_cotangents(q, sc[0], sp.q_block, dq)
    dk8, dks = fp8_layout.fp8_cotangents(k, sc[1], sp.k_block, dk)
    dv8, dvs = fp8_layout.fp8_cotangents(v, sc[2], sp.v_block, dv)
    # Scales replicated over the ring (one block): each device returns its share; the
    # shard_map's transpose sums the shares of an input it did not split.
    return dq8, dk8, dv8, none, (dqs, dks, dvs)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _fp8_setup(req, statics, q, k, L, layout, nseq, mesh, q_scale, k_scale, v_scale,
               batch_axis, head_axis, seq_axis, shapes):
    """(statics with the ring's Fp8Spec, canonical scales or None, their shard_map specs)."""
    spec = req.spec
    C = L // 2 if layout == "zigzag" else L
    blk = lambda g, b: L if g != "block" else b
    g = spec.granularity
    if spec.source == "quantized":
        if g != ("block",) * 3:
            raise ValueError("ring_attention with precision='fp8' quantizes per block of each "
                             "device's sequence (scale_granularity 'block')")
    for name, gg, b in zip(("q", "k", "v"), g, (spec.q_block, spec.k_block, spec.v_block)):
        if gg == "block" and C % b:
            raise ValueError(f"{name} scale blocks of {b} rows straddle the ring's chunks of "
                             f"{C} rows ({layout} layout over {nseq} devices); pick a "
                             f"scale_block that divides {C} ({shapes})")
    spec = dataclasses.replace(spec, q_block=blk(g[0], spec.q_block),
                               k_block=blk(g[1], spec.k_block), v_block=blk(g[2], spec.v_block))
    statics = dataclasses.replace(statics, fp8=spec)
    if spec.source == "quantized":
        return statics, None, None
    B, N, K = q.shape[0], q.shape[2], k.shape[2]
    scales = prec.canonical_scales(req, q_scale, k_scale, v_scale, (B,), N, K)
    if mesh is None:
        return statics, scales, None
    specs = tuple(P(batch_axis, head_axis, seq_axis if gg == "block" else None) for gg in g)
    return statics, scales, specs
