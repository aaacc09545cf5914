"""Per-block segment-id summaries computed in XLA before a kernel launch (DSL-free, jnp).

A CuTe kernel with segment ids needs, before its first load, which key blocks a query tile can
meet at all. Computing that here instead of scanning inside the kernel costs O(T/tile_m *
S/tile_n) compares in one fused XLA reduction (negligible next to the attention's O(T * S * H))
and leaves the kernel two integer loads per tile, identical for the producer warp (24
registers) and the consumers; a scan in the kernel would repeat O(S/tile_n) dependent global
loads in every CTA before any TMA could start.

Layout the kernels read (int32, row-major, batch first so `jax.vmap` folds into it):

- ``rows_info [B, ceil(T/tile_rows), 4]``: per row block (min segment, max segment, first
  column block, end column block): the column blocks [first, end) are the smallest contiguous
  range holding every column block whose [min, max] segment range meets this row block's.
  With sorted (document-packed) segments that range is exact, so the work is about the sum of
  the squared document lengths; with unsorted ids it stays correct (the element mask decides),
  only less is skipped. An empty range is (0, 0).
- ``cols_info [B, ceil(S/tile_cols), 2]``: per column block (min segment, max segment); a block
  pair whose four values are all equal needs no element mask.

Blocks are summarized over valid positions only (the padded tail of the last block is ignored).
The backward kernel can call the same function with rows = keys and columns = queries.
"""
from __future__ import annotations

_I32_MAX = 2**31 - 1
_I32_MIN = -2**31


def _block_min_max(seg, tile: int):
    import jax.numpy as jnp
    B, L = seg.shape
    nb = -(-L // tile)
    pad = nb * tile - L
    lo = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=_I32_MAX).reshape(B, nb, tile)
    hi = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=_I32_MIN).reshape(B, nb, tile)
    return lo.min(-1), hi.max(-1)


def block_summaries(row_seg, col_seg, tile_rows: int, tile_cols: int):
    """(rows_info [B, nr, 4], cols_info [B, nc, 2]) int32 for segment ids row_seg [B, T] and
    col_seg [B, S] (see the module docstring)."""
    import jax.numpy as jnp
    if row_seg.ndim != 2 or col_seg.ndim != 2 or row_seg.shape[0] != col_seg.shape[0]:
        raise ValueError(f"segment ids must be [B, T] and [B, S] with the same B; got "
                         f"{row_seg.shape} and {col_seg.shape}")
    row_seg = row_seg.astype(jnp.int32)
    col_seg = col_seg.astype(jnp.int32)
    rmin, rmax = _block_min_max(row_seg, tile_rows)
    cmin, cmax = _block_min_max(col_seg, tile_cols)
    nc = cmin.shape[1]
    if nc == 0:  # no keys: every range is empty
        zeros = jnp.zeros(rmin.shape, jnp.int32)
        return (jnp.stack([rmin, rmax, zeros, zeros], axis=-1).astype(jnp.int32),
                jnp.stack([cmin, cmax], axis=-1).astype(jnp.int32))
    meet = ((cmin[:, None, :] <= rmax[:, :, None])
            & (cmax[:, None, :] >= rmin[:, :, None]))  # [B, nr, nc]
    any_meet = meet.any(-1)
    first = jnp.argmax(meet, axis=-1).astype(jnp.int32)
    end = (nc - jnp.argmax(meet[..., ::-1], axis=-1)).astype(jnp.int32)
    first = jnp.where(any_meet, first, 0)
    end = jnp.where(any_meet, end, 0)
    rows_info = jnp.stack([rmin, rmax, first, end], axis=-1).astype(jnp.int32)
    cols_info = jnp.stack([cmin, cmax], axis=-1).astype(jnp.int32)
    return rows_info, cols_info
