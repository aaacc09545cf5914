"""Block sparsity: which (query block, key block) tiles of a mask_mod are empty, full or
partial, computed once per shape and reused across layers and steps.

`create_block_mask` evaluates the mask_mod densely, one query block at a time (memory
O(B H tm S) booleans at once), and keeps per (batch, head, query block) the indices of its
full and partial key blocks (full first-class: the kernels run them without evaluating the
mask), and the transposed lists per key block for the dK / dV backward. Empty tiles appear in
neither list and are never visited. A `BlockMask` is a pytree of int32 arrays with the block
sizes and the sequence lengths as static data, so it can be built inside ``jax.jit``, passed
through it, and sharded over its batch / head dims like any array.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxflash import _vma
from jaxflash.mods import dense
from jaxflash.mods.spec import make_spec, normalize_aux


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Per ``[Bm, Hm, nq]`` (Bm in {1, B}, Hm in {1, N}; size 1 broadcasts): ``full_count``
    / ``partial_count`` int32 and ``full_idx`` / ``partial_idx`` ``[Bm, Hm, nq, nk]`` int32
    (the key-block indices in ascending order, then padding). The ``*_t`` fields are the same
    per key block over query blocks (``[Bm, Hm, nk]``, ``[Bm, Hm, nk, nq]``). ``block`` =
    ``(tm, tn)`` and ``seq_lens`` = ``(T, S)`` are static."""

    full_count: jax.Array
    full_idx: jax.Array
    partial_count: jax.Array
    partial_idx: jax.Array
    full_count_t: jax.Array
    full_idx_t: jax.Array
    partial_count_t: jax.Array
    partial_idx_t: jax.Array
    # Per row, (lo, full_lo, full_hi, hi) of its visible blocks ([Bm, Hm, nq, 4] and, for the
    # transposed rows, [Bm, Hm, nk, 4]; `block_ranges`): the CuTe kernels' range table, kept
    # here so a call whose tiles are the mask's blocks converts nothing. None in a BlockMask
    # built by other means (the kernels then derive it from the lists).
    ranges: Optional[jax.Array] = None
    ranges_t: Optional[jax.Array] = None
    block: tuple = (128, 128)
    seq_lens: tuple = (0, 0)

    def tree_flatten(self):
        names = [f.name for f in dataclasses.fields(self)][:10]
        return tuple(getattr(self, n) for n in names), (self.block, self.seq_lens)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, block=static[0], seq_lens=static[1])

    @property
    def batch_heads(self) -> tuple[int, int]:
        return tuple(self.full_count.shape[:2])

    @property
    def num_blocks(self) -> tuple[int, int]:
        return tuple(self.full_idx.shape[2:])

    def density(self):
        """Fraction of tiles visited (full + partial), per ``[Bm, Hm]``."""
        nq, nk = self.num_blocks
        return (jnp.sum(self.full_count + self.partial_count, axis=-1) / (nq * nk))

    def __repr__(self):
        return (f"BlockMask(block={self.block}, seq_lens={self.seq_lens}, "
                f"batch_heads={self.batch_heads}, num_blocks={self.num_blocks})")


def _lists(kind):
    """[..., n, m] int8 kinds (0 empty, 1 partial, 2 full) -> per row: counts and ascending
    indices of the full and the partial columns (padding repeats the last valid index, so a
    kernel prefetching one past the end reads a valid block)."""
    m = kind.shape[-1]
    cols = jnp.arange(m, dtype=jnp.int32)
    out = []
    for k in (2, 1):
        hit = kind == k
        count = jnp.sum(hit, axis=-1, dtype=jnp.int32)
        # Stable order: hits first, ascending; the rest after (sorted by key hit*m - col).
        order = jnp.argsort(jnp.where(hit, cols, m + cols), axis=-1).astype(jnp.int32)
        last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
        pos = jnp.broadcast_to(cols, order.shape)
        idx = jnp.where(pos < count[..., None], order, jnp.where(count[..., None] > 0, last, 0))
        out += [count, idx.astype(jnp.int32)]
    return out


def _whole(x):
    """x replicated where its type splits it over Explicit mesh axes: the mask reads any
    element of an aux array from every block (as the kernels' calls do, `jaxflash.sharding`)."""
    sh = _vma.typed_sharding(x)
    if sh is None or all(e is None for e in sh.spec):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sh.mesh,
                                                              jax.sharding.PartitionSpec()))


def create_block_mask(mask_mod, B: int, H: int, T: int, S: int, block=(128, 128),
                      aux=()) -> BlockMask:
    """The `BlockMask` of `mask_mod` for batch `B` and heads `H` (1 each when the mask does
    not depend on them: it then broadcasts), T queries, S keys and tiles ``block = (tm, tn)``.

    ``aux`` is the mask's aux tuple, as passed to `flash_attention` (arrays, may be traced).
    Pass the same ``block`` the kernels will run: the Pallas fallback takes its tile sizes
    from the block mask (powers of two >= 16). Only pairs inside T x S count; a tile that
    holds no visible pair is empty, one whose every in-range pair is visible is full."""
    tm, tn = (int(block), int(block)) if isinstance(block, int) else map(int, block)
    for name, x in (("block rows", tm), ("block cols", tn)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16; got {x}")
    if min(B, H, T, S) <= 0:
        raise ValueError(f"B, H, T and S must be positive; got {(B, H, T, S)}")
    spec, leaves = make_spec(None, mask_mod, normalize_aux(aux))
    leaves = [_whole(x) for x in leaves]
    if spec is None:
        raise ValueError("create_block_mask needs a mask_mod")
    nq, nk = -(-T // tm), -(-S // tn)
    b_idx, h_idx = dense.indices(B), dense.indices(H)
    kv_idx = dense.indices(nk * tn)
    kv_ok = kv_idx < S

    def one_q_block(i):
        q_idx = i * tm + jnp.arange(tm, dtype=jnp.int32)
        m = dense.mask(spec, leaves, b_idx, h_idx, q_idx, kv_idx)     # [B, H, tm, nk*tn]
        ok = (q_idx < T)[:, None] & kv_ok[None, :]
        m = m.reshape(B, H, tm, nk, tn)
        ok = ok.reshape(tm, nk, tn)
        anyv = jnp.any(m & ok[None, None], axis=(2, 4))
        allv = jnp.all(m | ~ok[None, None], axis=(2, 4))
        return jnp.where(allv, 2, jnp.where(anyv, 1, 0)).astype(jnp.int8)  # [B, H, nk]

    kind = jax.lax.map(one_q_block, jnp.arange(nq, dtype=jnp.int32))  # [nq, B, H, nk]
    kind = jnp.moveaxis(kind, 0, 2)                                    # [B, H, nq, nk]
    fc, fi, pc, pi = _lists(kind)
    kind_t = jnp.swapaxes(kind, -1, -2)
    fct, fit, pct, pit = _lists(kind_t)
    return BlockMask(fc, fi, pc, pi, fct, fit, pct, pit,
                     ranges=block_ranges(kind > 0, kind == 2),
                     ranges_t=block_ranges(kind_t > 0, kind_t == 2),
                     block=(tm, tn), seq_lens=(T, S))


def block_ranges(nonempty, full):
    """[..., n] block classes -> [..., 4] int32 (lo, full_lo, full_hi, hi): the visible blocks
    lie in [lo, hi), and [full_lo, full_hi) is the longest run of full ones (the first of
    equals); an empty row is all 0, a row without full blocks has full_lo = full_hi = lo."""
    n = nonempty.shape[-1]
    j = jnp.arange(n, dtype=jnp.int32)
    any_ = nonempty.any(-1)
    lo = jnp.where(any_, jnp.argmax(nonempty, -1), 0).astype(jnp.int32)
    hi = jnp.where(any_, n - jnp.argmax(nonempty[..., ::-1], -1), 0).astype(jnp.int32)
    full = full & nonempty
    # run length of full blocks ending at j: j - (last non-full index before or at j)
    last_bad = jax.lax.cummax(jnp.where(full, -1, j), axis=full.ndim - 1)
    run = jnp.where(full, j - last_bad, 0)
    end = jnp.argmax(run, -1).astype(jnp.int32)
    best = jnp.max(run, -1).astype(jnp.int32)
    f_hi = jnp.where(best > 0, end + 1, lo)
    f_lo = jnp.where(best > 0, end + 1 - best, lo)
    return jnp.stack([lo, f_lo, f_hi, hi], -1)
