"""Backward kernels (FlashAttention-2 scheme, no atomics, so always deterministic):

1. delta = rowsum(dO * O) [B,N,T] float32: a fused elementwise-reduce that XLA already runs at
   memory bandwidth, so it is plain jnp, not a kernel.
2. dK/dV kernel: one program per (key block, batch, kv head). It loops over the G query heads
   of its group and over the query blocks that can see the key block, recomputing P from the
   saved LSE, so dK/dV are summed over the group in registers (GQA/MQA without K/V copies and
   without a reduction afterwards).
3. dQ kernel: one program per (query block, batch, query head), looping over key blocks. It
   also reduces the ALiBi slope gradient to per-row partial sums [B,N,T] (summed over B and T
   afterwards: O(T) memory, no T x S buffer).
4. dbias kernel, only built when there is a bias, and removed by XLA when its result is unused
   (a pallas_call without side effects is dead code then): one program per (query block, bias
   batch row, bias head); it loops over the key blocks and, inside, over the batch rows/heads
   that the bias broadcasts over, so dbias comes out in the bias's own shape.

Gradient of the logits: dS = P * (dP - delta) with dP = dO V^T (natural units); dbias = dS;
dslope = -|i-j| dS; through softcap dS *= 1 - tanh^2(scale qk / softcap); dQ = scale dS K,
dK = scale dS^T Q, dV = P^T dO.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import _vma
from jaxflash.pallas_fallback import mods_tile, tiles
from jaxflash.pallas_fallback.config import PassConfig
from jaxflash.pallas_fallback.tiles import Spec


def _probs(s, lse):
    """P from base-2 logits and the natural LSE; rows with LSE = -inf (nothing visible) get
    P = 0 (exp2(s - inf)) instead of exp2(-inf + inf) = NaN."""
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * tiles.LOG2E)
    return jnp.exp2(s - lse2[:, None])


def _probs_t(s_t, lse):
    """`_probs` for a transposed [bk, bq] tile."""
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * tiles.LOG2E)
    return jnp.exp2(s_t - lse2[None, :])


# ---- dK / dV ------------------------------------------------------------------------------

def _dkdv_kernel(*refs, spec: Spec, cfg: PassConfig, names):
    r = dict(zip(names, refs))
    bq, bk = cfg.block_q, cfg.block_k
    j, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_lo = j * bk
    k_idx = k_lo + jnp.arange(bk, dtype=jnp.int32)
    # Key rows past S are loaded as 0 and their dK/dV rows are never stored; they cannot leak
    # into other rows here, so no key-tail select is needed in this kernel.
    k_rows = tiles.bounds(k_idx, spec.S, bk)
    hq = tiles.head_ok(spec.Hp, spec.H)
    hv = tiles.head_ok(spec.Hvp, spec.Hv)
    k = tiles.load(r["k"], tiles.tile_mask(k_rows, hq))
    v = tiles.load(r["v"], tiles.tile_mask(k_rows, hv))
    q_len = r["q_len"][b] if spec.has_qlen else None
    kv_len = r["kv_len"][b] if spec.has_kvlen else None
    k_ids = tiles.load(r["kv_seg"], k_rows) if spec.has_seg else None
    q_tail = spec.T % bq != 0

    def head(g, carry):
        slope = r["alibi"][g] if spec.has_alibi else None
        n = h * spec.G + g            # the query head, as the mods see it
        mod = tiles.mod_tile(r, spec, b, n)

        def body(i, c, masked, mod_mask=True):
            dk, dv = c
            q_lo = i * bq
            q_idx = q_lo + jnp.arange(bq, dtype=jnp.int32)
            q_rows = tiles.bounds(q_idx, spec.T, bq) if masked else None
            qs = pl.ds(pl.multiple_of(q_lo, bq), bq)
            q = tiles.load(r["q"].at[qs, g, :], tiles.tile_mask(q_rows, hq))
            do = tiles.load(r["do"].at[qs, g, :], tiles.tile_mask(q_rows, hv))
            lse = tiles.load(r["lse"].at[g, qs], q_rows)
            delta = tiles.load(r["delta"].at[g, qs], q_rows)
            # Keys on rows ([bk, bq] tiles, as the Triton tutorial's backward): P^T and dS^T
            # come out of the dots in the layout the next dots consume, with no register
            # transposes of the big tiles; only the loaded q/dO tiles are read transposed.
            kq = tiles.dot_nt(k, q)
            bias = dm = q_ids = None
            # One indexer per access: Triton's lowering takes no chained .at[].at[].
            if spec.has_bias:
                ref = r["bias"].at[g, qs, :] if spec.bias_n else r["bias"].at[qs, :]
                bias = tiles.load(ref, tiles.tile_mask(q_rows, k_rows))
            if spec.has_mask:
                ref = r["mask"].at[g, qs, :] if spec.mask_n else r["mask"].at[qs, :]
                dm = tiles.load(ref, tiles.tile_mask(q_rows, k_rows))
            if spec.has_seg:
                q_ids = tiles.load(r["q_seg"].at[qs], q_rows)
            s_t = tiles.logits(kq, q_idx, k_idx, spec, static_masks=masked,
                               q_tail=masked and q_tail, k_tail=False, slope=slope, bias=bias,
                               dense_mask=dm, q_ids=q_ids, k_ids=k_ids, q_len=q_len,
                               kv_len=kv_len, transposed=True, mod=mod, mod_mask=mod_mask,
                               with_dmod=spec.has_score_mod)
            if spec.has_score_mod:
                s_t, dmod_t = s_t
            p_t = _probs_t(s_t, lse)
            dv = dv + tiles.dot_nn(p_t.astype(do.dtype), do)
            dp_t = tiles.dot_nt(v, do)
            ds_t = p_t * (dp_t - delta[None, :])
            if spec.has_score_mod:
                ds_t = ds_t * dmod_t
            if spec.softcap is not None:
                ds_t = ds_t * tiles.softcap_grad(kq, spec)
            dk = dk + tiles.dot_nn(ds_t.astype(q.dtype), q)
            return dk, dv

        if spec.sparse:
            tm, tn = spec.sparse
            return tiles.run_sparse(r, "bmt_", *tiles.sparse_bh(spec, b, n),
                                    tiles.block_row(j, tn // bk),
                                    body, carry, sub=tm // bq)
        lo, a, bb, hi = tiles.q_block_range(k_lo, bq, bk, spec, q_len=q_len, kv_len=kv_len)
        return tiles.run_split(lo, a, bb, hi, body, carry, static_masks=spec.static_masks,
                               any_full=spec.T >= bq)

    carry = (jnp.zeros((bk, spec.Hp), jnp.float32), jnp.zeros((bk, spec.Hvp), jnp.float32))
    dk, dv = lax.fori_loop(0, spec.G, head, carry)
    tiles.store(r["dk"], dk * spec.scale, tiles.tile_mask(k_rows, hq))
    tiles.store(r["dv"], dv, tiles.tile_mask(k_rows, hv))


def dkdv(q, k, v, do, lse, delta, ops, spec: Spec, cfg: PassConfig, *, interpret,
         compiler_params):
    B, T, N, _ = q.shape
    _, S, K, _ = k.shape
    G, bk = spec.G, cfg.block_k
    names = ["q", "k", "v", "do", "lse", "delta"]
    args = [q, k, v, do, lse, delta]
    specs = [
        pl.BlockSpec((None, T, G, spec.Hp), lambda j, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, bk, None, spec.Hp), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, spec.Hvp), lambda j, b, h: (b, j, h, 0)),
        pl.BlockSpec((None, T, G, spec.Hvp), lambda j, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0)),
        pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0)),
    ]
    for name, bdim, ndim in (("bias", spec.bias_b, spec.bias_n),
                             ("mask", spec.mask_b, spec.mask_n)):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec(
                (None, G if ndim else None, T, bk),
                functools.partial(_dense_index_k, bdim=bdim, ndim=ndim)))
    if "q_seg" in ops:
        names += ["q_seg", "kv_seg"]
        args += [ops["q_seg"], ops["kv_seg"]]
        specs += [pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),
                  pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
    for name in ("q_len", "kv_len"):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec((B,), lambda j, b, h: (0,)))
    if "alibi" in ops:
        names.append("alibi")
        args.append(ops["alibi"])
        specs.append(pl.BlockSpec((G,), lambda j, b, h: (h,)))
    extra = mods_tile.whole_inputs(ops, ("aux", "mod_off", "bmt_"))
    names, args, specs = names + extra[0], args + extra[1], specs + extra[2]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [pl.BlockSpec((None, bk, None, spec.Hp), lambda j, b, h: (b, j, h, 0)),
                 pl.BlockSpec((None, bk, None, spec.Hvp), lambda j, b, h: (b, j, h, 0))]
    kernel = functools.partial(_dkdv_kernel, spec=spec, cfg=cfg,
                               names=tuple(names + ["dk", "dv"]))
    return _vma.kernel_call(pl.pallas_call(
        kernel, grid=(pl.cdiv(S, bk), B, K), in_specs=specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="jaxflash_bwd_dkdv"), *args)


def _dense_index_k(j, b, h, *, bdim, ndim):
    if ndim:
        return (b if bdim else 0, h, 0, j)
    return (b if bdim else 0, 0, 0, j)


# ---- dQ (and the ALiBi slope gradient) -----------------------------------------------------

def _dq_kernel(*refs, spec: Spec, cfg: PassConfig, names):
    r = dict(zip(names, refs))
    bq, bk = cfg.block_q, cfg.block_k
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_lo = i * bq
    qt = tiles.query_tile(r, spec, b, n, q_lo, bq)
    do = tiles.load(r["do"], tiles.tile_mask(qt.rows, qt.hv))
    lse = tiles.load(r["lse"], qt.rows)
    delta = tiles.load(r["delta"], qt.rows)

    def body(j, carry, masked, mod_mask=True):
        dq, dal = carry
        kb = tiles.key_block_logits(r, spec, qt, j, bk, masked, mod_mask,
                                    with_dmod=spec.has_score_mod)
        s, qk, k, k_idx = kb.s, kb.qk, kb.k, kb.idx
        v = tiles.load(r["v"].at[kb.ks, :], tiles.tile_mask(kb.rows, qt.hv))
        p = _probs(s, lse)
        dp = tiles.dot_nt(do, v)
        ds = p * (dp - delta[:, None])
        if spec.has_alibi:
            # Per row: A = sum ds' dist, R = sum ds, M = sum p dist' (' after the score_mod's
            # derivative). The exact row sum R is 0; delta from the rounded output leaves it
            # at delta's error, which dist (up to T) would collect over every row: the slope
            # gradient takes dS re-centered, ds - p R, i.e. A - R M (stored below).
            dist = jnp.abs(qt.idx[:, None] - k_idx[None, :]).astype(jnp.float32)
            if spec.has_score_mod:
                dist = dist * kb.dmod
            dal = (dal[0] + jnp.sum(ds * dist, axis=1), dal[1] + jnp.sum(ds, axis=1),
                   dal[2] + jnp.sum(p * dist, axis=1))
        if spec.has_score_mod:  # dS of the logit before the score_mod
            ds = ds * kb.dmod
        if spec.softcap is not None:
            ds = ds * tiles.softcap_grad(qk, spec)
        dq = dq + tiles.dot_nn(ds.astype(k.dtype), k)
        return dq, dal

    zrow = jnp.zeros((bq,), jnp.float32)
    carry = (jnp.zeros((bq, spec.Hp), jnp.float32), (zrow, zrow, zrow))
    if spec.sparse:
        tm, tn = spec.sparse
        dq, dal = tiles.run_sparse(r, "bm_", *tiles.sparse_bh(spec, b, n),
                                   tiles.block_row(i, tm // bq),
                                   body, carry, sub=tn // bk)
    else:
        lo, a, bb, hi = tiles.k_block_range(q_lo, bq, bk, spec, q_len=qt.q_len,
                                             kv_len=qt.kv_len)
        dq, dal = tiles.run_split(lo, a, bb, hi, body, carry, static_masks=spec.static_masks,
                                  any_full=spec.S >= bk)
    tiles.store(r["dq"], dq * spec.scale, tiles.tile_mask(qt.rows, qt.hq))
    if spec.has_alibi:
        tiles.store(r["dalibi"], -(dal[0] - dal[1] * dal[2]), qt.rows)


def dq(q, k, v, do, lse, delta, ops, spec: Spec, cfg: PassConfig, *, interpret,
       compiler_params):
    """Returns (dq [B,T,N,H] q.dtype, per-row slope gradient [B,N,T] float32 or None)."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    G, bq = spec.G, cfg.block_q
    kvh = lambda n: tiles.idiv(n, G)
    names = ["q", "k", "v", "do", "lse", "delta"]
    args = [q, k, v, do, lse, delta]
    specs = [
        pl.BlockSpec((None, bq, None, spec.Hp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, S, None, spec.Hp), lambda i, b, n: (b, 0, kvh(n), 0)),
        pl.BlockSpec((None, S, None, spec.Hvp), lambda i, b, n: (b, 0, kvh(n), 0)),
        pl.BlockSpec((None, bq, None, spec.Hvp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
        pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
    ]
    for name, bdim, ndim in (("bias", spec.bias_b, spec.bias_n),
                             ("mask", spec.mask_b, spec.mask_n)):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec((None, None, bq, S),
                                      functools.partial(_dense_index_q, bdim=bdim, ndim=ndim)))
    if "q_seg" in ops:
        names += ["q_seg", "kv_seg"]
        args += [ops["q_seg"], ops["kv_seg"]]
        specs += [pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
                  pl.BlockSpec((None, S), lambda i, b, n: (b, 0))]
    for name, size in (("q_len", B), ("kv_len", B), ("alibi", N)):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec((size,), lambda i, b, n: (0,)))
    extra = mods_tile.whole_inputs(ops, ("aux", "mod_off", "bm_"))
    names, args, specs = names + extra[0], args + extra[1], specs + extra[2]
    out_names = ["dq"]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, bq, None, spec.Hp), lambda i, b, n: (b, i, n, 0))]
    if spec.has_alibi:
        out_names.append("dalibi")
        out_shape.append(jax.ShapeDtypeStruct((B, N, T), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)))
    kernel = functools.partial(_dq_kernel, spec=spec, cfg=cfg, names=tuple(names + out_names))
    outs = _vma.kernel_call(pl.pallas_call(
        kernel, grid=(pl.cdiv(T, bq), B, N), in_specs=specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="jaxflash_bwd_dq"), *args)
    return outs[0], (outs[1] if spec.has_alibi else None)


def _dense_index_q(i, b, n, *, bdim, ndim):
    return (b if bdim else 0, n if ndim else 0, i, 0)


# ---- dbias -----------------------------------------------------------------------------------

def _dbias_kernel(*refs, spec: Spec, cfg: PassConfig, names, RB: int, RN: int):
    r = dict(zip(names, refs))
    bq, bk = cfg.block_q, cfg.block_k
    i, bb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_lo = i * bq
    q_idx = q_lo + jnp.arange(bq, dtype=jnp.int32)
    q_rows = tiles.bounds(q_idx, spec.T, bq)
    hq = tiles.head_ok(spec.Hp, spec.H)
    hv = tiles.head_ok(spec.Hvp, spec.Hv)
    nk = -(-spec.S // bk)

    def k_block(j, _):
        k_lo = j * bk
        k_idx = k_lo + jnp.arange(bk, dtype=jnp.int32)
        k_rows = tiles.bounds(k_idx, spec.S, bk)
        ks = pl.ds(pl.multiple_of(k_lo, bk), bk)
        bias = tiles.load(r["bias"].at[:, ks], tiles.tile_mask(q_rows, k_rows))

        def pair(t, acc):
            # (rb, rn): the batch row / head inside this program's broadcast group.
            rb, rn = tiles.idiv(t, RN), tiles.irem(t, RN)
            b = bb * RB + rb          # global batch row and query head
            n = nb * RN + rn
            kh = tiles.idiv(rn, spec.G) if RN > 1 else jnp.int32(0)  # a Python 0 trips the discharge
            q = tiles.load(r["q"].at[rb, :, rn, :], tiles.tile_mask(q_rows, hq))
            do = tiles.load(r["do"].at[rb, :, rn, :], tiles.tile_mask(q_rows, hv))
            lse = tiles.load(r["lse"].at[rb, rn, :], q_rows)
            delta = tiles.load(r["delta"].at[rb, rn, :], q_rows)
            k = tiles.load(r["k"].at[rb, ks, kh, :], tiles.tile_mask(k_rows, hq))
            v = tiles.load(r["v"].at[rb, ks, kh, :], tiles.tile_mask(k_rows, hv))
            dm = q_ids = k_ids = None
            if spec.has_mask:
                zero = jnp.int32(0)
                ref = r["mask"].at[b if spec.mask_b else zero, n if spec.mask_n else zero, :, ks]
                dm = tiles.load(ref, tiles.tile_mask(q_rows, k_rows))
            if spec.has_seg:
                q_ids = tiles.load(r["q_seg"].at[b, :], q_rows)
                k_ids = tiles.load(r["kv_seg"].at[b, ks], k_rows)
            slope = r["alibi"][n] if spec.has_alibi else None
            q_len = r["q_len"][b] if spec.has_qlen else None
            kv_len = r["kv_len"][b] if spec.has_kvlen else None
            s = tiles.logits(tiles.dot_nt(q, k), q_idx, k_idx, spec, static_masks=True,
                             q_tail=False, k_tail=spec.S % bk != 0, slope=slope, bias=bias,
                             dense_mask=dm, q_ids=q_ids, k_ids=k_ids, q_len=q_len,
                             kv_len=kv_len, mod=tiles.mod_tile(r, spec, b, n),
                             with_dmod=spec.has_score_mod)
            dmod = 1.0
            if spec.has_score_mod:
                s, dmod = s
            p = _probs(s, lse)
            dp = tiles.dot_nt(do, v)
            return acc + p * (dp - delta[:, None]) * dmod

        acc = lax.fori_loop(0, RB * RN, pair, jnp.zeros((bq, bk), jnp.float32))
        tiles.store(r["dbias"].at[:, ks], acc, tiles.tile_mask(q_rows, k_rows))
        return 0

    lax.fori_loop(0, nk, k_block, 0)


def dbias(q, k, v, do, lse, delta, ops, spec: Spec, cfg: PassConfig, *, interpret,
          compiler_params):
    """dbias in the bias's shape [Bb, Nb, T, S] (Bb in {1, B}, Nb in {1, N})."""
    B, T, N, _ = q.shape
    _, S, K, _ = k.shape
    bias = ops["bias"]
    Bb, Nb = bias.shape[:2]
    RB, RN = B // Bb, N // Nb   # rows / heads each program sums over
    bq = cfg.block_q
    kh = (lambda nb: 0) if RN > 1 else (lambda nb: tiles.idiv(nb, spec.G))
    KB = K if RN > 1 else 1
    names = ["q", "k", "v", "do", "lse", "delta", "bias"]
    args = [q, k, v, do, lse, delta, bias]
    specs = [
        pl.BlockSpec((RB, bq, RN, spec.Hp), lambda i, bb, nb: (bb, i, nb, 0)),
        pl.BlockSpec((RB, S, KB, spec.Hp), lambda i, bb, nb: (bb, 0, kh(nb), 0)),
        pl.BlockSpec((RB, S, KB, spec.Hvp), lambda i, bb, nb: (bb, 0, kh(nb), 0)),
        pl.BlockSpec((RB, bq, RN, spec.Hvp), lambda i, bb, nb: (bb, i, nb, 0)),
        pl.BlockSpec((RB, RN, bq), lambda i, bb, nb: (bb, nb, i)),
        pl.BlockSpec((RB, RN, bq), lambda i, bb, nb: (bb, nb, i)),
        pl.BlockSpec((None, None, bq, S), lambda i, bb, nb: (bb, nb, i, 0)),
    ]
    if "mask" in ops:
        m = ops["mask"]
        names.append("mask")
        args.append(m)
        specs.append(pl.BlockSpec((m.shape[0], m.shape[1], bq, S),
                                  lambda i, bb, nb: (0, 0, i, 0)))
    if "q_seg" in ops:
        names += ["q_seg", "kv_seg"]
        args += [ops["q_seg"], ops["kv_seg"]]
        specs += [pl.BlockSpec((B, bq), lambda i, bb, nb: (0, i)),
                  pl.BlockSpec((B, S), lambda i, bb, nb: (0, 0))]
    for name, size in (("q_len", B), ("kv_len", B), ("alibi", N)):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec((size,), lambda i, bb, nb: (0,)))
    extra = mods_tile.whole_inputs(ops, ("aux", "mod_off"))
    names, args, specs = names + extra[0], args + extra[1], specs + extra[2]
    kernel = functools.partial(_dbias_kernel, spec=spec, cfg=cfg,
                               names=tuple(names + ["dbias"]), RB=RB, RN=RN)
    return _vma.kernel_call(pl.pallas_call(
        kernel, grid=(pl.cdiv(T, bq), Bb, Nb), in_specs=specs,
        out_specs=pl.BlockSpec((None, None, bq, S), lambda i, bb, nb: (bb, nb, i, 0)),
        out_shape=jax.ShapeDtypeStruct(bias.shape, bias.dtype), interpret=interpret,
        compiler_params=compiler_params, name="jaxflash_bwd_dbias"), *args)
