"""The mods evaluated densely, on index grids: what the reference, the block-mask builder and
the aux gradient use. The user's scalar functions are mapped with nested `jax.vmap`s over
(batch, head, query, key), each index batched only on its own axis, so the result is exactly
the scalar definition at every point; gradients, aux included, are jax's own."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash.mods.spec import ModSpec


def _grid(f, with_score: bool):
    """f(score?, b, h, q, kv) on scalars -> on (score [B,N,T,S]?, b [B], h [N], q [T], kv [S])."""
    for pos in (3, 2, 1, 0):  # innermost (key) first; the score is mapped at every level
        axes = tuple(0 if i == pos else None for i in range(4))
        f = jax.vmap(f, in_axes=((0,) + axes) if with_score else axes)
    return f


def scores(spec: ModSpec, s, aux_leaves, b_idx, h_idx, q_idx, kv_idx):
    """score_mod applied to logits ``s [B, N, T, S]`` (float32) at the given index vectors
    (``b_idx [B]``, ``h_idx [N]``, ``q_idx [T]``, ``kv_idx [S]``, int32)."""
    flat = spec.flat_score()
    f = lambda x, b, h, q, kv: flat(x, b, h, q, kv, *aux_leaves).astype(s.dtype)
    return _grid(f, True)(s, b_idx, h_idx, q_idx, kv_idx)


def mask(spec: ModSpec, aux_leaves, b_idx, h_idx, q_idx, kv_idx):
    """mask_mod on the grid: bool ``[B, N, T, S]`` (True = attend)."""
    flat = spec.flat_mask()
    f = lambda b, h, q, kv: flat(b, h, q, kv, *aux_leaves)
    return _grid(f, False)(b_idx, h_idx, q_idx, kv_idx)


def indices(n: int, start=0):
    return jnp.asarray(start, jnp.int32) + jnp.arange(n, dtype=jnp.int32)


def batch_heads(arrays, B: int, N: int):
    """The batch and head index vectors the mods see: global ones (a shard's offsets added)."""
    off = arrays.mod_offsets
    if off is None:
        return indices(B), indices(N)
    return indices(B, off[0]), indices(N, off[1])
