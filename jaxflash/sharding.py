"""Batch / head SPMD partitioning of every backend's forward and backward.

Under `jax.jit` with q, k, v sharded over a mesh on the batch dim and/or the head dims, XLA would
otherwise treat an attention kernel (a Pallas call, an FFI custom call) as opaque and all-gather
its operands. Attention is independent per (batch row, kv head group), so each shard can run the
backend on its own slice with no communication. `forward` and `backward` wrap the backend in
`jax.experimental.custom_partitioning` to say exactly that, to both partitioners:

- Shardy (the default): a sharding rule in einsum notation, one factor per dim; batch and head
  factors pass through, sequence dims and head dims are ``need_replication`` factors
  (sequence sharding is ring attention's job, `jaxflash.ring`).
- GSPMD: `infer_sharding_from_operands` gives the result shardings.

Both end in `partition`, which fixes one plan from q's sharding (k's when q's heads are not
sharded): batch axes, query-head axes and kv-head axes consistent with the GQA grouping (query
head n reads kv head n // G, so a shard holds whole kv heads with all their query heads, or one
kv head with a slice of its group); operands that disagree are resharded to it. It then
recomputes the `Problem` for the local shapes and runs the backend on each shard.

The only communication ever added is in the backward, for gradients of operands broadcast over
a sharded dim: a size-1 batch/head dim of `bias`, `alibi_slopes` over the batch, and dK/dV
when the query heads of one kv head are split over devices (sharded query heads beyond the kv
heads, e.g. MQA): those are summed over the shards with `psum`.

With mods (`jaxflash.mods`), each shard's mods must still see global batch rows and heads:
`partition` hands the backend the shard's offsets (``arrays.mod_offsets``, from the mesh axis
indices); aux arrays are replicated and their gradients summed over the shards; a block mask
is split with the batch / head dims it has. Backends that do not read the offsets
(``Backend.shards_mods`` False), and calls with a rank-0 aux leaf (no dim to name in the rule),
run whole.

Calls that need none of this skip it entirely (no second trace, nothing in the HLO): a process
with a single device, eager calls, and calls traced under `vmap` (custom_partitioning has no
batching rule; such calls run unpartitioned, as any jnp code would). A jaxpr that already holds
the op and is vmapped later (vmap of a jitted or checkpointed function) gets the op's body
batched by the rule registered below.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import NamedTuple, Optional

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxflash import _vma
from jaxflash._types import AttentionArrays, Problem

logger = logging.getLogger("jaxflash")

try:  # jit-traced values; anything else (eager arrays, vmap tracers) runs unpartitioned.
    from jax._src.interpreters.partial_eval import DynamicJaxprTracer as _JitTracer
except ImportError:  # pragma: no cover - moved in some jax version: partition every traced call
    _JitTracer = jax.core.Tracer


def _register_batching():
    """custom_partitioning has no batching rule, and a jaxpr holding our op can still meet vmap
    (vmap of a jitted or checkpointed function). Batch the op's own body then: same result,
    unpartitioned. Registered only if JAX has none (private API: skipped if it moves)."""
    try:
        from jax._src import core as jcore
        from jax._src.custom_partitioning import custom_partitioning_p as prim
        from jax._src.interpreters import batching
    except ImportError:  # pragma: no cover
        return
    registry = getattr(batching, "fancy_primitive_batchers", batching.primitive_batchers)
    if prim in registry:
        return

    def rule(args, dims, *, call, **_):
        nm = getattr(batching, "not_mapped", None)
        axes = tuple(None if d is nm else d for d in dims)
        outs = jax.vmap(jcore.jaxpr_as_fun(call), in_axes=axes)(*args)
        return outs, [0] * len(outs)

    batching.primitive_batchers[prim] = rule


_register_batching()


def forward(backend, q, k, v, arrays: AttentionArrays, statics, plan):
    """``backend.forward``, partitioned over sharded batch / head dims under jit."""
    _check_mapped(backend, q, k, v, arrays)
    mesh = explicit_mesh(q, k, v, arrays)
    if mesh is not None:
        return _explicit("fwd", mesh, backend, statics, plan, (q, k, v, arrays))
    # Inside a caller's shard_map with JAX's varying-axes checks on, the operands are per-device
    # arrays already: no partitioning op (its lowering would re-trace the body with the checks
    # on). Kernel calls type their own results (`jaxflash._vma`); the results are cast once
    # more for backends that compute some in XLA from fewer operands.
    axes = _vma.varying_axes(q, k, v, arrays)
    if axes or not _wanted(q, k, v) or not _mods_ok(backend, statics, arrays):
        res = backend.forward(q, k, v, arrays, statics, plan)
    else:
        op = _op("fwd", _Layout.of(q, k, v, arrays, statics))
        res = op(backend, q, k, v, arrays, statics, plan)
    return _vma.vary(res, axes)


def backward(backend, q, k, v, arrays: AttentionArrays, statics, plan, out, lse, dout):
    """``backend.backward``, partitioned over sharded batch / head dims under jit."""
    _check_mapped(backend, q, k, v, arrays)
    mesh = explicit_mesh(q, k, v, arrays)
    if mesh is not None:
        return _explicit("bwd", mesh, backend, statics, plan,
                         (q, k, v, arrays, out, lse, dout))
    axes = _vma.varying_axes(q, k, v, arrays, out, lse, dout)   # (as the forward's)
    if axes or not _wanted(q, k, v) or not _mods_ok(backend, statics, arrays):
        res = backend.backward(q, k, v, arrays, statics, plan, out, lse, dout)
    else:
        op = _op("bwd", _Layout.of(q, k, v, arrays, statics))
        res = op(backend, q, k, v, arrays, statics, plan, out, lse, dout)
    return _vma.vary(res, axes)




def explicit_mesh(*operands):
    """The mesh when an operand's type names a mesh axis of type Explicit (sharding in types,
    `jax.make_mesh`'s default), else None. Such operands are typed shards, not global arrays
    the partitioner may split: a kernel traced on them (a Pallas call's refs, a reshape of a
    split head dim) fails, so `_explicit` runs the backend under `shard_map` instead."""
    for x in jax.tree.leaves(operands):
        mesh = _explicit_in_type(x)
        if mesh is not None:
            return mesh
    return None


def _explicit_in_type(x):
    """x's mesh when its type splits a dim over an Explicit axis, else None."""
    sh = _vma.typed_sharding(x)
    if sh is None:
        return None
    explicit = _vma.explicit_axes(sh.mesh)
    return sh.mesh if any(set(_axes(e)) & explicit for e in sh.spec) else None


def _check_mapped(backend, *operands):
    """Under vmap a type is one example's; the batched value's own type may split the mapped
    dim over Explicit axes. The Pallas kernels cannot take that (their interpreter and
    lowering see the split inside the kernel): say so instead of failing deep in JAX."""
    if getattr(backend, "name", "") != "pallas":
        return
    for x in jax.tree.leaves(operands):
        while isinstance(x, _vma.BatchTracer):
            dim, x = x.batch_dim, x.val
            sh = getattr(jax.typeof(x), "sharding", None)
            spec = tuple(getattr(sh, "spec", ()) or ())
            if (isinstance(dim, int) and dim < len(spec) and spec[dim] is not None
                    and _explicit_in_type(x) is not None):
                raise NotImplementedError(
                    "the Pallas kernels under jax.vmap over a dim split on Explicit mesh "
                    f"axes ({jax.typeof(x)}): reshard that dim, or take another backend "
                    "(implementation='xla', or the default dispatch)")


def _explicit(kind, mesh, backend, statics, call_plan, args):
    """A pass on operands sharded in their types: the same plan as `_partition`'s (read from the
    types), operands resharded to it, and each shard running `_local` under `shard_map`. A call
    that cannot be split (the plan shards nothing, or its mods cannot take offsets) runs whole
    on operands resharded to replicated; the forward's result comes back split as q is."""
    q, k, v, arrays = args[:4]
    layout = _Layout.of(q, k, v, arrays, statics)
    plan = _Plan((), (), ())
    if _mods_ok(backend, statics, arrays):
        plan = _make_plan(mesh, jax.typeof(q).sharding, jax.typeof(k).sharding,
                          call_plan.problem)
    arg_sh, res_sh = _shardings(kind, mesh, plan, layout)
    args = jax.tree.map(jax.sharding.reshard, args, arg_sh)
    spec = lambda tree: jax.tree.map(lambda s: s.spec, tree)
    # Even a call the plan runs whole goes through shard_map: inside it the operands are plain
    # per-device arrays, which every backend's tracing takes (Pallas's interpreter, for one,
    # refuses values typed on an Explicit mesh). check_vma off: kernel calls (Pallas, FFI)
    # give outputs without varying-axes types; the specs say how each result is split, and
    # `_local` adds the psums it needs.
    run = jax.shard_map(_local(kind, backend, statics, call_plan, plan, layout), mesh=mesh,
                        in_specs=spec(arg_sh), out_specs=spec(res_sh), check_vma=False)
    results = run(*args)
    if kind == "fwd":
        # The result split as q is (a split the plan could not keep, a sequence split, ran
        # whole): each device keeps its slice, no communication.
        qs = tuple(jax.typeof(q).sharding.spec) + (None,) * 4
        ns = lambda *d: NamedSharding(mesh, P(*d))
        out, lse = results
        results = (jax.sharding.reshard(out, ns(qs[0], qs[1], qs[2], None)),
                   jax.sharding.reshard(lse, ns(qs[0], qs[2], qs[1])))
    return results


def _mods_ok(backend, statics, arrays) -> bool:
    """Whether a call with mods can be partitioned: its backend must give the mods the shard's
    global indices (``backend.shards_mods``), and a rank-0 aux leaf has no dim for the rule to
    name. Otherwise the call runs whole (correct, gathered)."""
    if getattr(statics, "mods", None) is None:
        return True
    return getattr(backend, "shards_mods", False) and not any(x.ndim == 0
                                                              for x in arrays.mod_aux)


def _wanted(*xs) -> bool:
    return jax.device_count() > 1 and all(isinstance(x, _JitTracer) for x in xs)


class _Layout(NamedTuple):
    """Which optional operands a call has and which of their dims are broadcast (size 1): the
    sharding rule depends on exactly this (plus the GQA group size)."""

    group: int
    bias: Optional[tuple[bool, bool]]  # (batch dim full, head dim full), None if absent
    mask: Optional[tuple[bool, bool]]
    q_seqlen: bool
    kv_seqlen: bool
    alibi: bool
    segments: bool
    fp8: bool = False  # FP8 scales [B, N, nq], [B, K, nk], [B, K, nv] ride along (batch, heads)
    # With mods: (aux leaves' ranks, which leaves get gradients, the block mask's
    # (batch dim full, head dim full, block, seq_lens) or None); None without mods.
    mods: Optional[tuple] = None

    @classmethod
    def of(cls, q, k, v, arrays: AttentionArrays, statics=None) -> "_Layout":
        B, N = q.shape[0], q.shape[2]

        def dense(x):
            # A dim of size 1 is "broadcast" unless the full dim is 1 too (then it is full).
            return None if x is None else (x.shape[0] == B, x.shape[1] == N)

        mods = None
        spec = getattr(statics, "mods", None)
        if spec is not None:
            bm = arrays.block_mask
            bmd = None if bm is None else (dense(bm.full_count) + (tuple(bm.block),
                                                                   tuple(bm.seq_lens),
                                                                   bm.ranges is not None))
            grads = tuple(spec.has_score and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                          for x in arrays.mod_aux)
            mods = (tuple(x.ndim for x in arrays.mod_aux), grads, bmd)
        return cls(group=N // k.shape[2], bias=dense(arrays.bias), mask=dense(arrays.mask),
                   q_seqlen=arrays.q_seqlen is not None, kv_seqlen=arrays.kv_seqlen is not None,
                   alibi=arrays.alibi_slopes is not None,
                   segments=arrays.q_segment_ids is not None,
                   fp8=arrays.q_scale is not None, mods=mods)

    def rule(self, kind: str):
        """Shardy rule (einsum string, need_replication factors, factor sizes)."""
        # Query heads: the kv-head factor itself for MHA; for GQA/MQA a factor of their own.
        # (The compound "(k g)" would tie them to the kv heads, but Shardy then splits a mesh
        # axis into sub-axes when its size does not divide K, which JAX's custom_partitioning
        # cannot hand to `partition`; `_make_plan` keeps q and k/v consistent instead.)
        nq = "k" if self.group == 1 else "n"
        repl = ["t", "s", "h", "hv"]

        def dense(full, name):
            bf, nf = full
            b = "b" if bf else f"{name}b1"
            n = nq if nf else f"{name}n1"
            repl.extend(x for x in (b, n) if x.endswith("1"))
            return f"{b} {n} t s"

        q, kk, vv = f"b t {nq} h", "b s k h", "b s k hv"
        ops = [q, kk, vv]
        bias = dense(self.bias, "bias") if self.bias else None
        ops += [bias] if bias else []
        ops += [dense(self.mask, "mask")] if self.mask else []
        ops += ["b"] if self.q_seqlen else []
        ops += ["b"] if self.kv_seqlen else []
        ops += [nq] if self.alibi else []
        ops += ["b t", "b s"] if self.segments else []
        if self.fp8:  # the scale-block dims stay whole, like the sequence dims they index
            ops += [f"b {nq} qsb", "b k ksb", "b k vsb"]
            repl += ["qsb", "ksb", "vsb"]
        aux_ops = []
        if self.mods is not None:
            # aux leaves: replicated (every shard reads them whole); block mask: split with the
            # batch / query heads it has, its tile dims replicated.
            ranks, _, bmd = self.mods
            for i, r in enumerate(ranks):
                aux_ops.append(" ".join(f"aux{i}d{d}" for d in range(r)))
                repl.extend(f"aux{i}d{d}" for d in range(r))
            ops += aux_ops
            if bmd is not None:
                b = "b" if bmd[0] else "bmb1"
                n = nq if bmd[1] else "bmn1"
                repl.extend(x for x in (b, n, "bmq", "bmk") if x.startswith("bm"))
                ops += [f"{b} {n} bmq", f"{b} {n} bmq bmk"] * 2
                ops += [f"{b} {n} bmk", f"{b} {n} bmk bmq"] * 2
                if bmd[4]:  # the kept range tables: per row, four ints
                    ops += [f"{b} {n} bmq bmr", f"{b} {n} bmk bmr"]
                    repl.append("bmr")
        out, lse = f"b t {nq} hv", f"b {nq} t"
        if kind == "fwd":
            res = [out, lse]
        else:
            ops += [out, lse, out]
            res = [q, kk, vv] + ([bias] if bias else []) + ([nq] if self.alibi else [])
            if self.mods is not None:
                res += [a for a, g in zip(aux_ops, self.mods[1]) if g]
        sizes = {}
        rule = f"{', '.join(ops)} -> {', '.join(res)}"
        # Shardy wants special factors in the order they first appear (their factor index).
        order = [w for w in rule.replace(",", " ").replace("(", " ").replace(")", " ").split()]
        repl = sorted(set(repl), key=order.index)
        return rule, tuple(repl), sizes


def _zero_offsets(arrays, statics, q):
    """The op's global body sees offsets (0, 0), as a shard sees its own: a backend then builds
    what depends on them from traced values (custom_partitioning takes no captured constants,
    which a backend may otherwise fold an offset-free table into). The zeros are computed from
    q (an empty sum), so they are traced too: a jnp.zeros would be a captured constant."""
    if getattr(statics, "mods", None) is None or arrays.mod_offsets is not None:
        return arrays
    zero = jax.lax.convert_element_type(jax.numpy.sum(q[:0]), jax.numpy.int32)
    return arrays._replace(mod_offsets=jax.numpy.broadcast_to(zero, (2,)))


@functools.lru_cache(maxsize=None)
def _op(kind: str, layout: _Layout):
    """One custom_partitioning op per (direction, layout); static args: backend, statics,
    plan (all hashable)."""
    if kind == "fwd":
        def fun(backend, q, k, v, arrays, statics, plan):
            return backend.forward(q, k, v, _zero_offsets(arrays, statics, q), statics, plan)
        static = (0, 5, 6)
    else:
        def fun(backend, q, k, v, arrays, statics, plan, out, lse, dout):
            return backend.backward(q, k, v, _zero_offsets(arrays, statics, q), statics, plan,
                                    out, lse, dout)
        static = (0, 5, 6)
    op = custom_partitioning(fun, static_argnums=static)
    rule, repl, sizes = layout.rule(kind)
    op.def_partition(
        partition=functools.partial(_partition, kind),
        infer_sharding_from_operands=functools.partial(_infer, kind),
        sharding_rule=rule, need_replication_factors=repl, **sizes)
    return op


# ---------------------------------------------------------------------------------------------
# The plan: which mesh axes shard the batch, the query heads and the kv heads.


@dataclasses.dataclass(frozen=True)
class _Plan:
    batch: tuple[str, ...]
    q_heads: tuple[str, ...]
    kv_heads: tuple[str, ...]

    def spec(self, *dims):
        """PartitionSpec from dim kinds: 'b', 'n' (query heads), 'k' (kv heads) or None."""
        pick = {"b": self.batch, "n": self.q_heads, "k": self.kv_heads}
        out = []
        for d in dims:
            axes = pick.get(d, ())
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _make_plan(mesh, q_sharding, k_sharding, problem: Problem) -> _Plan:
    """The plan from q's sharding (k's for a dim q does not shard). Kv heads take the leading
    query-head axes whose product divides K; any further axes must then split the group of a
    single kv head (the only blocks of N = K x G that are a kv-head block times a group block).
    Head sharding that fits neither is dropped (heads replicated: the partitioner gathers them),
    as is any we cannot read."""
    def spec_of(sh):
        spec = getattr(sh, "spec", None)
        return None if spec is None else tuple(spec) + (None,) * (4 - len(spec))

    qs, ks = spec_of(q_sharding), spec_of(k_sharding)
    if qs is None:  # not a NamedSharding (no mesh known): nothing to keep
        return _Plan((), (), ())
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    batch = _axes(qs[0]) or (_axes(ks[0]) if ks else ())
    if problem.batch % size(batch):
        batch = ()
    heads = _axes(qs[2])
    if not heads and ks:  # kv heads sharded, query heads not: shard q along (whole groups)
        kv = _axes(ks[2])
        ok = problem.num_kv_heads % size(kv) == 0 and not set(kv) & set(batch)
        return _Plan(batch, kv, kv) if ok else _Plan(batch, (), ())
    kv = ()
    for i in range(len(heads) + 1):
        if problem.num_kv_heads % size(heads[:i]) == 0:
            kv = heads[:i]
        else:
            break
    rest = heads[len(kv):]
    ok = (problem.num_heads % size(heads) == 0
          and (not rest or (size(kv) == problem.num_kv_heads
                            and problem.group_size % size(rest) == 0)))
    if not ok:
        logger.info("head sharding %s dropped for %d query / %d kv heads: each device needs "
                    "whole kv heads or a split group of one; heads run whole (gathered)",
                    heads, problem.num_heads, problem.num_kv_heads)
        heads, kv = (), ()
    return _Plan(batch, heads, kv)


def _shardings(kind, mesh, plan: _Plan, layout: _Layout):
    """(arg shardings, result shardings) as pytrees matching the op's operands and results."""
    ns = lambda *dims: NamedSharding(mesh, plan.spec(*dims))
    q, kv = ns("b", None, "n", None), ns("b", None, "k", None)
    dense = lambda full: None if full is None else ns("b" if full[0] else None,
                                                      "n" if full[1] else None, None, None)
    aux, bm, daux = (), None, ()
    if layout.mods is not None:
        from jaxflash.mods import BlockMask
        ranks, grads, bmd = layout.mods
        aux = tuple(ns(*([None] * r)) for r in ranks)
        daux = tuple(a if g else None for a, g in zip(aux, grads))
        if bmd is not None:
            c = ns("b" if bmd[0] else None, "n" if bmd[1] else None, None)
            i = ns("b" if bmd[0] else None, "n" if bmd[1] else None, None, None)
            r = i if bmd[4] else None
            bm = BlockMask(c, i, c, i, c, i, c, i, ranges=r, ranges_t=r, block=bmd[2],
                           seq_lens=bmd[3])
    arrays = AttentionArrays(
        bias=dense(layout.bias), mask=dense(layout.mask),
        q_seqlen=ns("b") if layout.q_seqlen else None,
        kv_seqlen=ns("b") if layout.kv_seqlen else None,
        alibi_slopes=ns("n") if layout.alibi else None,
        q_segment_ids=ns("b", None) if layout.segments else None,
        kv_segment_ids=ns("b", None) if layout.segments else None,
        q_scale=ns("b", "n", None) if layout.fp8 else None,
        k_scale=ns("b", "k", None) if layout.fp8 else None,
        v_scale=ns("b", "k", None) if layout.fp8 else None,
        mod_aux=aux, block_mask=bm)
    out, lse = q, ns("b", "n", None)
    if kind == "fwd":
        return (q, kv, kv, arrays), (out, lse)
    grads = (q, kv, kv, arrays.bias, arrays.alibi_slopes)
    return ((q, kv, kv, arrays, out, lse, out),
            grads + ((daux,) if layout.mods is not None else ()))


def _infer(kind, backend, statics, call_plan, mesh, arg_shapes, result_shape):
    """GSPMD: result shardings from the operands' (Shardy uses the rule instead)."""
    layout = _Layout.of(*arg_shapes[:3], arg_shapes[3], statics)
    plan = _make_plan(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding, call_plan.problem)
    return _shardings(kind, mesh, plan, layout)[1]


def _partition(kind, backend, statics, call_plan, mesh, arg_shapes, result_shape):
    """Per-shard lowering: the backend on local shapes, plus the psums of broadcast grads.
    The call's plan holds for every shard: batch and heads are split, never the sequence or
    head dims that variants depend on, and launches read batch and head counts at run time."""
    layout = _Layout.of(*arg_shapes[:3], arg_shapes[3], statics)
    plan = _make_plan(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding, call_plan.problem)
    arg_sh, res_sh = _shardings(kind, mesh, plan, layout)
    return mesh, _local(kind, backend, statics, call_plan, plan, layout), res_sh, arg_sh


def _local(kind, backend, statics, call_plan, plan: _Plan, layout: _Layout):
    """What one shard runs (inside `custom_partitioning`'s lowering or `shard_map`): the backend
    on its local slice, the mods told the shard's global offsets, and the backward's psums."""

    def offsets(q, arrays):
        """The mods see global batch rows and heads: this shard's first ones."""
        if layout.mods is None:
            return arrays
        idx = lambda axes, n: (jax.lax.axis_index(axes) * n if axes else 0)
        off = jax.numpy.stack([jax.numpy.asarray(idx(plan.batch, q.shape[0]), "int32"),
                               jax.numpy.asarray(idx(plan.q_heads, q.shape[2]), "int32")])
        return arrays._replace(mod_offsets=off)

    if kind == "fwd":
        def lower(q, k, v, arrays):
            return backend.forward(q, k, v, offsets(q, arrays), statics, call_plan)
    else:
        def lower(q, k, v, arrays, out, lse, dout):
            grads = backend.backward(
                q, k, v, offsets(q, arrays), statics, call_plan, out, lse, dout)
            dq, dk, dv, dbias, dalibi = grads[:5]
            group_axes = plan.q_heads[len(plan.kv_heads):]
            if group_axes:  # a kv head's query heads are split: its dK/dV are partial sums
                dk, dv = jax.lax.psum((dk, dv), group_axes)
            if dbias is not None:
                # A size-1 (broadcast) dim of bias collects gradient from every shard of it.
                axes = ((plan.batch if not layout.bias[0] else ())
                        + (plan.q_heads if not layout.bias[1] else ()))
                if axes:
                    dbias = jax.lax.psum(dbias, axes)
            if dalibi is not None and plan.batch:
                dalibi = jax.lax.psum(dalibi, plan.batch)
            if layout.mods is None:
                return dq, dk, dv, dbias, dalibi
            # aux is read by every shard: its gradient is the sum of the shards' parts.
            axes = plan.batch + plan.q_heads
            daux = tuple(g if g is None or not axes else jax.lax.psum(g, axes)
                         for g in grads[5])
            return dq, dk, dv, dbias, dalibi, daux
    return lower
