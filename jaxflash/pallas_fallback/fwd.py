"""Forward kernel: one program per (query block, batch, query head); it walks the key blocks
that can hold a visible pair with an online softmax (FlashAttention-2), keeping the output
accumulator, row max and row sum in registers. Writes out [B,T,N,Hv] and lse [B,N,T] (natural
log, -inf for rows with no visible key).

K/V are read through the index_map at head ``n // G``: GQA/MQA never copies K/V. Bias and mask
keep their size-1 batch/head dims; the index_map pins those to block 0.
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


def _kernel(*refs, spec: Spec, cfg: PassConfig, names: tuple[str, ...]):
    r = dict(zip(names, refs))
    bq, bk = cfg.block_q, cfg.block_k
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_lo = i * bq
    qt = tiles.query_tile(r, spec, b, n, q_lo, bq)

    def body(j, carry, masked, mod_mask=True):
        acc, m, l = carry
        kb = tiles.key_block_logits(r, spec, qt, j, bk, masked, mod_mask)
        s = kb.s
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row with nothing visible so far keeps m = -inf; exponentiate against 0 instead so
        # no inf - inf appears (its p and alpha are then exactly 0). A +inf logit is treated
        # the same way, as the reference does: its row's LSE is +inf (not NaN), the row NaN.
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = tiles.load(r["v"].at[kb.ks, :], tiles.tile_mask(kb.rows, qt.hv))
        acc = acc * alpha[:, None] + tiles.dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l

    carry = (jnp.zeros((bq, spec.Hvp), jnp.float32),
             jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    if spec.sparse:
        tm, tn = spec.sparse
        acc, m, l = tiles.run_sparse(r, "bm_", *tiles.sparse_bh(spec, b, n),
                                     tiles.block_row(i, tm // bq),
                                     body, carry, sub=tn // bk)
    else:
        lo, a, bb, hi = tiles.k_block_range(q_lo, bq, bk, spec, q_len=qt.q_len,
                                             kv_len=qt.kv_len)
        acc, m, l = tiles.run_split(lo, a, bb, hi, body, carry, static_masks=spec.static_masks,
                                    any_full=spec.S >= bk)

    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    tiles.store(r["o"], acc / l_safe[:, None], tiles.tile_mask(qt.rows, qt.hv))
    m_use = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(empty, -jnp.inf, (m_use + jnp.log2(l_safe)) * tiles.LN2)
    tiles.store(r["lse"], lse, qt.rows)


def forward(q, k, v, ops: dict, spec: Spec, cfg: PassConfig, *, interpret: bool,
            compiler_params):
    """ops: the optional operands present (bias, mask [int8], q_seg, kv_seg, q_len, kv_len,
    alibi), already in kernel form. Returns (out [B,T,N,Hv] q.dtype, lse [B,N,T] float32)."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    bq = cfg.block_q
    G = spec.G
    kvh = lambda n: tiles.idiv(n, G)
    names = ["q", "k", "v"]
    args = [q, k, v]
    specs = [
        pl.BlockSpec((None, bq, None, spec.Hp), lambda i, b, n: (b, i, n, 0)),
        pl.BlockSpec((None, S, None, spec.Hp), lambda i, b, n: (b, 0, kvh(n), 0)),
        pl.BlockSpec((None, S, None, spec.Hvp), lambda i, b, n: (b, 0, kvh(n), 0)),
    ]
    for name, bdim, ndim in (("bias", spec.bias_b, spec.bias_n), ("mask", spec.mask_b,
                                                                  spec.mask_n)):
        if name in ops:
            names.append(name)
            args.append(ops[name])
            specs.append(pl.BlockSpec(
                (None, None, bq, S),
                functools.partial(_dense_index, bdim=bdim, ndim=ndim)))
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
    out_shape = [jax.ShapeDtypeStruct((B, T, N, v.shape[-1]), q.dtype),
                 jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bq, None, spec.Hvp), lambda i, b, n: (b, i, n, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))]
    kernel = functools.partial(_kernel, spec=spec, cfg=cfg, names=tuple(names + ["o", "lse"]))
    out, lse = _vma.kernel_call(pl.pallas_call(
        kernel, grid=(pl.cdiv(T, bq), B, N), in_specs=specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="jaxflash_fwd"), *args)
    return out, lse


def _dense_index(i, b, n, *, bdim, ndim):
    return (b if bdim else 0, n if ndim else 0, i, 0)
