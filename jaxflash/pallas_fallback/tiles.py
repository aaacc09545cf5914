"""What every kernel does to one (query block, key block) tile, written once.

- `Spec`: the static description of a call that the kernels specialize on.
- `load` / `store`: bounds-masked memory access (tails of T and S, padded head dims).
- `logits`: raw scores -> logits in base-2 units (x log2 e, so the kernels can use exp2) with
  every mask applied as -inf, through `jaxflash.masking` (the one definition of the semantics).
- `q_block_range` / `k_block_range`: which blocks a program must visit, split into the ones
  that need the causal/window select and the fully visible ones that do not.

Index arithmetic uses `lax.div` on non-negative int32 values: Python's `//` on traced scalars
lowers to a floor division that Triton's lowering rejects.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import masking
from jaxflash.pallas_fallback import mods_tile

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

try:  # Masked loads/stores: Triton's primitives (they also run in interpret mode).
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - every jax we support has it
    _plgpu = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static facts the kernels specialize on (hashable)."""

    T: int
    S: int
    H: int          # q/k head dim
    Hv: int         # v head dim
    Hp: int         # padded head dims (power of two >= 16)
    Hvp: int
    G: int          # query heads per kv head
    scale: float
    is_causal: bool
    window: Optional[tuple[int, int]]
    softcap: Optional[float]
    has_alibi: bool
    has_bias: bool
    has_mask: bool
    has_seg: bool    # segment ids
    has_qlen: bool   # query seq lengths ([B] int32, read as one scalar per program)
    has_kvlen: bool
    bias_b: bool = False   # bias has a real batch dim (else size 1, broadcast by index_map)
    bias_n: bool = False   # bias has a real head dim
    mask_b: bool = False
    mask_n: bool = False
    mods: Optional[object] = None      # `jaxflash.mods.ModSpec`: score_mod / mask_mod
    n_aux: int = 0                     # aux leaves, passed as whole inputs aux0, aux1, ...
    mod_offsets: bool = False          # a shard's (batch, head) offsets, input mod_off
    sparse: Optional[tuple[int, int]] = None   # a block mask's (tm, tn): its lists choose tiles
    bm_b: bool = False                 # the block mask has a real batch / head dim
    bm_n: bool = False

    @property
    def plain_logits(self) -> bool:
        return (self.softcap is None and not self.has_alibi and not self.has_bias
                and not self.has_score_mod)

    @property
    def has_score_mod(self) -> bool:
        return self.mods is not None and self.mods.has_score

    @property
    def has_mask_mod(self) -> bool:
        return self.mods is not None and self.mods.has_mask

    @property
    def static_masks(self) -> bool:
        return self.is_causal or self.window is not None


def and_(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return jnp.logical_and(a, b)


def tile_mask(rows_ok, cols_ok):
    """[r] and [c] bounds predicates (or None) -> [r, c] (or None)."""
    if rows_ok is None and cols_ok is None:
        return None
    if rows_ok is None:
        return cols_ok[None, :]
    if cols_ok is None:
        return rows_ok[:, None]
    return jnp.logical_and(rows_ok[:, None], cols_ok[None, :])


def load(ref, mask=None, other=0):
    """Read a ref (view); masked-off elements read `other`. On Triton, out-of-bounds addresses
    are never touched when masked; in interpret mode Pallas pads, and the mask hides it."""
    if mask is None:
        return ref[...]
    return _plgpu.load(ref, mask=mask, other=other)


def store(ref, val, mask=None):
    if mask is None:
        ref[...] = val.astype(ref.dtype)
    else:
        _plgpu.store(ref, val.astype(ref.dtype), mask=mask)


def bounds(idx, n, block):
    """``idx < n`` when the block may run past n (tail), else None (no select emitted)."""
    return idx < n if n % block else None


def head_ok(hp: int, h: int):
    return jnp.arange(hp) < h if hp != h else None


def dot_nt(a, b):
    """a [m, d] x b [n, d] -> [m, n] float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=_prec(a))


def dot_tn(a, b):
    """a [d, m] x b [d, n] -> [m, n] float32 (a transposed)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=_prec(a))


def dot_nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=_prec(a))


def _prec(a):
    # float32 inputs must not silently drop to tf32 on GPUs: the tests hold them to 2e-5.
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def logits(qk, q_idx, k_idx, spec: Spec, *, static_masks: bool, q_tail: bool, k_tail: bool,
           slope=None, bias=None, dense_mask=None, q_ids=None, k_ids=None, q_len=None,
           kv_len=None, transposed: bool = False, mod=None, mod_mask: bool = True,
           with_dmod: bool = False):
    """qk = q.k (float32 [bq, bk]) -> logits x log2(e), masked entries -inf.

    `static_masks=False` skips the causal/window select for tiles known to be fully visible;
    q_tail/k_tail add ``q_idx < T`` / ``k_idx < S`` for blocks that may run past the end;
    q_len/kv_len (the call's seq lengths, clipped to [0, T] / [0, S]) cover the tails too.
    `mod` (a `mods_tile.ModTile`): the score_mod applied after the built-in transforms, the
    mask_mod (unless `mod_mask` is False: a tile the block mask knows is full). `with_dmod`
    returns ``(s, dmod)``, dmod = d score_mod / d score (0 where masked; 1 without one).
    """
    # Row/column broadcasting of the per-query and per-key vectors; transposed tiles
    # ([bk, bq], used by the dK/dV kernel) put keys on rows. bias/mask come as [bq, bk].
    if transposed:
        qi, ki = q_idx[None, :], k_idx[:, None]
        qs_ = None if q_ids is None else q_ids[None, :]
        ks_ = None if k_ids is None else k_ids[:, None]
        bias = None if bias is None else bias.T
        dense_mask = None if dense_mask is None else dense_mask.T
    else:
        qi, ki = q_idx[:, None], k_idx[None, :]
        qs_ = None if q_ids is None else q_ids[:, None]
        ks_ = None if k_ids is None else k_ids[None, :]
    if q_len is None and q_tail:
        q_len = spec.T
    if kv_len is None and k_tail:
        kv_len = spec.S
    dmod = None
    if spec.plain_logits:
        s = qk * (spec.scale * LOG2E)
    else:
        s = masking.transform_logits(qk, qi, ki, scale=spec.scale,
                                     softcap=spec.softcap, alibi_slope=slope, bias=bias)
        if spec.has_score_mod:
            s = mods_tile.score(mod, s, qi, ki, with_deriv=with_dmod)
            if with_dmod:
                s, dmod = s
        s = s * LOG2E
    keep = masking.keep(
        qi, ki,
        is_causal=spec.is_causal and static_masks,
        window=spec.window if static_masks else None,
        q_seqlen=q_len, kv_seqlen=kv_len, q_seg=qs_, kv_seg=ks_)
    if dense_mask is not None:
        keep = and_(keep, dense_mask != 0)
    if spec.has_mask_mod and mod_mask:
        keep = and_(keep, mods_tile.mask(mod, qi, ki, s.shape))
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
        if dmod is not None:
            dmod = jnp.where(keep, dmod, 0.0)
    if with_dmod:
        return s, (jnp.ones_like(s) if dmod is None else dmod)
    return s


def softcap_grad(qk, spec: Spec):
    """d(softcap * tanh(x / softcap))/dx at x = qk * scale (1 where there is no softcap)."""
    t = jnp.tanh(qk * (spec.scale / spec.softcap))
    return 1.0 - t * t


# ---- which blocks a program visits --------------------------------------------------------

def _int_type(x):
    return x.dtype if hasattr(x, "dtype") else jnp.int32


def idiv(x, n):
    """x // n for a non-negative integer x (traced or a Python int: int32) and a static n, in
    x's integer type (under jax_enable_x64 a Python int would be int64 beside an int32 grid
    index)."""
    t = _int_type(x)
    return lax.div(lax.convert_element_type(x, t), lax.convert_element_type(n, t))


def irem(x, n):
    """x % n, as `idiv`."""
    t = _int_type(x)
    return lax.rem(lax.convert_element_type(x, t), lax.convert_element_type(n, t))


def _cdiv(x, n):
    return idiv(x + lax.convert_element_type(n - 1, _int_type(x)), n)


def _clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def k_block_range(q_lo, bq: int, bk: int, spec: Spec, q_len=None, kv_len=None):
    """For the query block [q_lo, q_lo + bq): key blocks (lo, a, b, hi). Blocks in [lo, hi) may
    hold a visible pair; those in [a, b) are fully visible under causal/window and are not the
    ragged last block, so they skip the static select. Blocks outside [lo, hi) are skipped."""
    nk = -(-spec.S // bk)
    q_lo = jnp.asarray(q_lo, jnp.int32)
    q_hi = q_lo + bq
    lo = jnp.int32(0)
    hi = jnp.int32(nk)
    a, b = lo, jnp.int32(spec.S // bk)  # the ragged last block always takes the masked path
    if spec.is_causal:
        hi = jnp.minimum(hi, _cdiv(q_hi, bk))
        b = jnp.minimum(b, idiv(q_lo + 1, bk))
    if spec.window is not None:
        left, right = spec.window
        lo = jnp.maximum(lo, idiv(jnp.maximum(q_lo - left, 0), bk))
        hi = jnp.minimum(hi, idiv(q_hi - 1 + right, bk) + 1)
        a = jnp.maximum(a, _cdiv(jnp.maximum(q_hi - 1 - left, 0), bk))
        b = jnp.minimum(b, idiv(q_lo + right + 1, bk))
    if kv_len is not None:  # keys past the length are never visible
        hi = jnp.minimum(hi, _cdiv(kv_len, bk))
    if q_len is not None:  # a query block past the length has nothing to do
        hi = jnp.where(q_lo >= q_len, lo, hi)
    lo = jnp.minimum(lo, nk)
    hi = jnp.maximum(hi, lo)
    a = _clamp(a, lo, hi)
    b = _clamp(b, a, hi)
    return lo, a, b, hi


def q_block_range(k_lo, bq: int, bk: int, spec: Spec, q_len=None, kv_len=None):
    """For the key block [k_lo, k_lo + bk): query blocks (lo, a, b, hi), as `k_block_range`."""
    nq = -(-spec.T // bq)
    k_lo = jnp.asarray(k_lo, jnp.int32)
    k_hi = k_lo + bk
    lo = jnp.int32(0)
    hi = jnp.int32(nq)
    a, b = lo, jnp.int32(spec.T // bq)
    if spec.is_causal:
        lo = jnp.maximum(lo, idiv(k_lo, bq))
        a = jnp.maximum(a, _cdiv(k_hi - 1, bq))
    if spec.window is not None:
        left, right = spec.window
        lo = jnp.maximum(lo, idiv(jnp.maximum(k_lo - right, 0), bq))
        hi = jnp.minimum(hi, idiv(k_hi - 1 + left, bq) + 1)
        a = jnp.maximum(a, _cdiv(jnp.maximum(k_hi - 1 - right, 0), bq))
        b = jnp.minimum(b, idiv(k_lo + left + 1, bq))
    if q_len is not None:
        hi = jnp.minimum(hi, _cdiv(q_len, bq))
    if kv_len is not None:
        hi = jnp.where(k_lo >= kv_len, lo, hi)
    lo = jnp.minimum(lo, nq)
    hi = jnp.maximum(hi, lo)
    a = _clamp(a, lo, hi)
    b = _clamp(b, a, hi)
    return lo, a, b, hi


def run_sparse(r, prefix: str, bb, hh, row, body, carry, sub: int = 1):
    """With a block mask: the full tiles of `row` (no mask_mod), then its partial ones, from
    the mask's lists ``{prefix}fc / fi / pc / pi`` at (batch row `bb`, head `hh`). The kernel's
    blocks may be smaller than the mask's (powers of two, so they divide them): each listed
    tile is `sub` kernel blocks, walked in one flat loop. Every block keeps the built-in masks
    and the tails (``masked=True``); empty tiles are never visited."""
    def walk(kind, mod_mask, carry):
        n = r[prefix + kind + "c"][bb, hh, row]

        def step(u, c):
            t = lax.div(u, jnp.int32(sub)) if sub > 1 else u
            blk = r[prefix + kind + "i"][bb, hh, row, t]
            if sub > 1:
                blk = blk * sub + lax.rem(u, jnp.int32(sub))
            return body(blk, c, True, mod_mask)
        return lax.fori_loop(0, n * sub, step, carry)

    return walk("p", True, walk("f", False, carry))


def block_row(i, ratio: int):
    """The block mask's row of kernel block `i` when `ratio` kernel blocks make one mask tile."""
    return i if ratio == 1 else lax.div(i, jnp.int32(ratio))


def sparse_bh(spec: Spec, b, n):
    """The block mask's (batch row, head) for program (b, n): 0 where it broadcasts."""
    return (b if spec.bm_b else jnp.int32(0)), (n if spec.bm_n else jnp.int32(0))


def run_split(lo, a, b, hi, body, carry, *, static_masks: bool, any_full: bool = True):
    """fori_loop over [lo, hi) calling ``body(j, carry, masked)``, with the fully visible part
    [a, b) unmasked. Without causal/window there is one unmasked loop and the ragged tail.
    `any_full=False` (the sequence is shorter than one block) leaves the unmasked loop out: it
    would never run, and its unmasked full-block reads would not even trace."""
    if not any_full:
        return lax.fori_loop(lo, hi, lambda j, c: body(j, c, True), carry)
    if not static_masks:
        carry = lax.fori_loop(lo, b, lambda j, c: body(j, c, False), carry)
        return lax.fori_loop(b, hi, lambda j, c: body(j, c, True), carry)
    carry = lax.fori_loop(lo, a, lambda j, c: body(j, c, True), carry)
    carry = lax.fori_loop(a, b, lambda j, c: body(j, c, False), carry)
    return lax.fori_loop(b, hi, lambda j, c: body(j, c, True), carry)


class QueryTile(NamedTuple):
    """What a program that owns one query block (forward, dQ) reads once, before its key loop."""

    idx: object      # [bq] global query positions
    rows: object     # [bq] rows inside T (None when the block cannot be ragged)
    hq: object       # head-dim validity of q/k columns (None when unpadded)
    hv: object       # head-dim validity of v columns
    q: object        # [bq, Hp] query tile
    slope: object    # ALiBi slope of this head, or None
    q_len: object
    kv_len: object
    q_ids: object    # [bq] segment ids, or None
    mod: object      # `mods_tile.ModTile` of this program, or None


def query_tile(r, spec: Spec, b, n, q_lo, bq: int) -> QueryTile:
    idx = q_lo + jnp.arange(bq, dtype=jnp.int32)
    rows = bounds(idx, spec.T, bq)
    hq = head_ok(spec.Hp, spec.H)
    return QueryTile(
        idx=idx, rows=rows, hq=hq, hv=head_ok(spec.Hvp, spec.Hv),
        q=load(r["q"], tile_mask(rows, hq)),
        slope=r["alibi"][n] if spec.has_alibi else None,
        q_len=r["q_len"][b] if spec.has_qlen else None,
        kv_len=r["kv_len"][b] if spec.has_kvlen else None,
        q_ids=load(r["q_seg"], rows) if spec.has_seg else None,
        mod=mod_tile(r, spec, b, n))


def mod_tile(r, spec: Spec, b, n):
    """The mods' view for batch row `b`, query head `n` (None without mods). Aux leaves of
    rank 0 travel as shape (1,) (a block needs a dim) and are read back as scalars."""
    if spec.mods is None:
        return None
    aux = []
    for i, (shape, _) in enumerate(spec.mods.aux_avals):
        ref = r[f"aux{i}"]
        aux.append(ref[0] if shape == () else ref)
    b, n = jnp.asarray(b, jnp.int32), jnp.asarray(n, jnp.int32)
    if spec.mod_offsets:  # the mods see global indices on a shard
        b, n = b + r["mod_off"][0], n + r["mod_off"][1]
    return mods_tile.ModTile(spec.mods, b, n, tuple(aux))


class KeyBlock(NamedTuple):
    s: object        # [bq, bk] logits (masked entries -inf)
    qk: object       # [bq, bk] raw q.k (the softcap derivative needs it)
    k: object        # [bk, Hp] key tile
    idx: object      # [bk] global key positions
    ks: object       # the key slice, for the caller's V load
    rows: object     # [bk] rows inside S (None on the unmasked path)
    dmod: object = None  # [bq, bk] d score_mod / d score (with_dmod only)


def key_block_logits(r, spec: Spec, qt: QueryTile, j, bk: int, masked: bool,
                     mod_mask: bool = True, with_dmod: bool = False) -> KeyBlock:
    """Logits of query tile `qt` against key block `j` (bias, dense mask and segment ids of that
    block loaded here), shared by the forward and dQ kernels. Only the masked path can meet the
    ragged last key block (see `k_block_range`), so the unmasked path skips the bounds."""
    k_lo = j * bk
    k_idx = k_lo + jnp.arange(bk, dtype=jnp.int32)
    k_rows = bounds(k_idx, spec.S, bk) if masked else None
    ks = pl.ds(pl.multiple_of(k_lo, bk), bk)
    k = load(r["k"].at[ks, :], tile_mask(k_rows, qt.hq))
    qk = dot_nt(qt.q, k)
    bias = dm = k_ids = None
    if spec.has_bias:
        bias = load(r["bias"].at[:, ks], tile_mask(qt.rows, k_rows))
    if spec.has_mask:
        dm = load(r["mask"].at[:, ks], tile_mask(qt.rows, k_rows))
    if spec.has_seg:
        k_ids = load(r["kv_seg"].at[ks], k_rows)
    s = logits(qk, qt.idx, k_idx, spec, static_masks=masked, q_tail=False,
               k_tail=masked and spec.S % bk != 0, slope=qt.slope, bias=bias, dense_mask=dm,
               q_ids=qt.q_ids, k_ids=k_ids, q_len=qt.q_len, kv_len=qt.kv_len, mod=qt.mod,
               mod_mask=mod_mask, with_dmod=with_dmod)
    dmod = None
    if with_dmod:
        s, dmod = s
    return KeyBlock(s=s, qk=qk, k=k, idx=k_idx, ks=ks, rows=k_rows, dmod=dmod)
