"""The mask_mod's block range tables, computed in XLA from the same program the kernel runs.

Each tile row (a query block in the forward, a key block in the backward) gets four int32:
(lo, full_lo, full_hi, hi). Blocks outside [lo, hi) hold no visible element and are never
loaded; blocks in [full_lo, full_hi) (the longest run of fully visible blocks) run with no
mask; the others evaluate the mask_mod per element. This is exact for every mask whose visible
blocks in a row are contiguous (causal, windows, documents, prefix-LM, chunks); for others the
range is their hull and the empty blocks inside it are computed, masked, instead of skipped.

Elements past the sequence ends are "don't care" (the kernels mask the key tail and never
store rows past T). Dims the program ignores are kept at size 1 (`FwdConfig` reads them
broadcast). The backward's table (rows = key blocks) is the union over each GQA group's query
heads, since one CTA walks them all with one range. Cost: the mask is evaluated once per
element in XLA, blockwise (``lax.map`` over block rows), fused with the reductions. A mask
that reads no aux array (causal, windows, chunks, a fixed prefix) has the same table for every
call of a shape: `constant_table` computes it once, while tracing, and the kernel gets it as a
constant, so no call pays for the evaluation (with aux, the caller's `BlockMask` does that).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash.kernels.variants.mod_program import parse
from jaxflash.mods.block_mask import block_ranges

_NAMES = {"f32": jnp.float32, "i32": jnp.int32, "bool": jnp.bool_}
_LAX = {"neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "floor": lax.floor,
        "ceil": lax.ceil, "exp": lax.exp, "exp2": lax.exp2, "log": lax.log,
        "log1p": lax.log1p, "expm1": lax.expm1, "tanh": lax.tanh, "logistic": lax.logistic,
        "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "square": lambda x: x * x,
        "one_minus_square": lambda x: 1 - x * x,
        "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem,
        "max": lax.max, "min": lax.min, "and": lax.bitwise_and, "or": lax.bitwise_or,
        "xor": lax.bitwise_xor, "not": lax.bitwise_not, "eq": lax.eq, "ne": lax.ne,
        "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge,
        "clamp": lax.clamp}   # (round: by its param, below)


def evaluate(prog, inputs: dict, aux=()) -> tuple:
    """The program's outputs on broadcastable arrays (`inputs`: s / b / h / q / k), in XLA."""
    env = dict(inputs)
    auxd = {}
    i = 0
    for name, dt, shape in prog.inputs:
        if name.startswith("x"):
            auxd[name] = jnp.asarray(aux[i], _NAMES[dt])
            i += 1

    def val(a):
        return env[a] if isinstance(a, str) else jnp.asarray(a[0], _NAMES[a[1]])

    for e in prog.eqns:
        if e.prim == "ds":
            arr = auxd[e.args[0]]
            idx = tuple(jnp.clip(val(a), 0, n - 1) for a, n in zip(e.args[1:], arr.shape))
            env[e.out] = arr[idx]
            continue
        args = [val(a) for a in e.args]
        if e.prim == "integer_pow":
            r = lax.integer_pow(args[0], e.param)
        elif e.prim == "round":
            r = lax.round(args[0], lax.RoundingMethod.TO_NEAREST_EVEN if e.param == "even"
                          else lax.RoundingMethod.AWAY_FROM_ZERO)
        elif e.prim == "convert_element_type":
            r = args[0].astype(_NAMES[e.param])
        elif e.prim == "select_n":
            args = jnp.broadcast_arrays(*args)
            r = lax.select_n(*args)
        else:
            r = _LAX[e.prim](*jnp.broadcast_arrays(*args)) if len(args) > 1 else \
                _LAX[e.prim](args[0])
        env[e.out] = r.astype(_NAMES[e.dtype])
    return tuple(val(a) for a in prog.outs)


def _classes(prog, aux, Bb, Hb, rows: int, cols: int, row_tile: int, col_tile: int,
             rows_are_keys: bool, offsets=None):
    """(nonempty, full) [Bb, Hb, row blocks, col blocks] bool; `offsets`: the global (batch,
    head) of index 0 (a shard's), or None."""
    nr = -(-rows // row_tile)
    nc = -(-cols // col_tile)
    c = jnp.arange(nc * col_tile, dtype=jnp.int32)
    b = jnp.arange(Bb, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(Hb, dtype=jnp.int32)[None, :, None, None]
    if offsets is not None:
        b = b + jnp.asarray(offsets, jnp.int32)[0]
        h = h + jnp.asarray(offsets, jnp.int32)[1]

    def one(i):
        r = i * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
        rr, cc = r[None, None, :, None], c[None, None, None, :]
        q, k = (cc, rr) if rows_are_keys else (rr, cc)
        m, = evaluate(prog, {"b": b, "h": h, "q": q, "k": k}, aux)
        m = jnp.broadcast_to(m, (Bb, Hb, row_tile, nc * col_tile))
        dc = (rr >= rows) | (cc >= cols)
        ne = (m & ~dc).reshape(Bb, Hb, row_tile, nc, col_tile).any(axis=(2, 4))
        full = (m | dc).reshape(Bb, Hb, row_tile, nc, col_tile).all(axis=(2, 4))
        return ne, full

    per = max(1, (1 << 24) // max(1, Bb * Hb * row_tile * nc * col_tile))
    ne, full = lax.map(one, jnp.arange(nr, dtype=jnp.int32), batch_size=min(per, nr))
    return jnp.moveaxis(ne, 0, 2), jnp.moveaxis(full, 0, 2)


def _dims(prog, B: int, N: int):
    return (B if prog.uses("b") else 1), (N if prog.uses("h") else 1)


def forward_table(mask_text: str, aux, B: int, N: int, T: int, S: int, tile_m: int,
                  tile_n: int, offsets=None):
    """[Bb, Hb, ceil(T / tile_m), 4] int32: per query tile, its key-block ranges (`offsets`:
    a shard's first global (batch, head), or None)."""
    prog = parse(mask_text)
    Bb, Hb = _dims(prog, B, N)
    ne, full = _classes(prog, aux, Bb, Hb, T, S, tile_m, tile_n, False, offsets)
    return block_ranges(ne, full)


def backward_table(mask_text: str, aux, B: int, N: int, K: int, T: int, S: int, tile_m: int,
                   tile_n: int, offsets=None):
    """[Bb, Kb, ceil(S / tile_n), 4] int32: per key block, its query-block ranges, the union
    over the query heads of each KV head's group."""
    prog = parse(mask_text)
    Bb, Hb = _dims(prog, B, N)
    ne, full = _classes(prog, aux, Bb, Hb, S, T, tile_n, tile_m, True, offsets)
    if Hb > 1 and N != K:
        G = N // K
        ne = ne.reshape(Bb, K, G, *ne.shape[2:]).any(2)
        full = full.reshape(Bb, K, G, *full.shape[2:]).all(2)
    return block_ranges(ne, full)


def _kinds(count_full, idx_full, count_part, idx_part, n: int):
    """[..., rows] counts and [..., rows, m] index lists -> [..., rows, n] int8 kinds (0 empty,
    1 partial, 2 full); list padding scatters 0."""
    pos = jnp.arange(idx_full.shape[-1], dtype=jnp.int32)
    lead = tuple(jnp.indices(idx_full.shape)[:-1])
    kinds = jnp.zeros(idx_full.shape[:-1] + (n,), jnp.int8)
    for count, idx, code in ((count_part, idx_part, 1), (count_full, idx_full, 2)):
        val = jnp.where(pos < count[..., None], code, 0).astype(jnp.int8)
        kinds = kinds.at[lead + (idx,)].max(val)
    return kinds


def table_from_block_mask(bm, tile_rows: int, tile_cols: int, rows_are_keys: bool, N: int,
                          K: int, n_cols: int):
    """A kernel table from a `jaxflash.mods.BlockMask` built once by the caller (no mask
    evaluation here), or None when its blocks do not line up with the kernel's tiles: its
    row blocks must equal the kernel's and its column blocks be a multiple (each then
    splits into equal kernel blocks of the same kind)."""
    tm, tn = bm.block
    rows_b, cols_b = (tn, tm) if rows_are_keys else (tm, tn)
    if rows_b != tile_rows or cols_b % tile_cols:
        return None
    kept = bm.ranges_t if rows_are_keys else bm.ranges
    f = cols_b // tile_cols
    bm_cols = bm.num_blocks[0 if rows_are_keys else 1]   # the mask's blocks along a row
    if (kept is not None and not (rows_are_keys and kept.shape[1] > 1 and N != K)
            and n_cols == bm_cols * f):
        # The ranges the BlockMask keeps, in kernel blocks (each of its blocks is f of them,
        # of its kind): no conversion at the call (the GQA union of the backward excepted).
        return kept * jnp.int32(f)
    if rows_are_keys:
        kinds = _kinds(bm.full_count_t, bm.full_idx_t, bm.partial_count_t, bm.partial_idx_t,
                       bm.full_idx.shape[-2])
    else:
        kinds = _kinds(bm.full_count, bm.full_idx, bm.partial_count, bm.partial_idx,
                       bm.full_idx.shape[-1])
    kinds = jnp.repeat(kinds, cols_b // tile_cols, axis=-1)[..., :n_cols]
    ne, full = kinds > 0, kinds == 2
    Hb = ne.shape[1]
    if rows_are_keys and Hb > 1 and N != K:
        G = N // K
        ne = ne.reshape(ne.shape[0], K, G, *ne.shape[2:]).any(2)
        full = full.reshape(full.shape[0], K, G, *full.shape[2:]).all(2)
    return block_ranges(ne, full)


def reads_aux(mask_text: str) -> bool:
    """Whether the mask program's output depends on an aux array."""
    prog = parse(mask_text)
    return any(prog.uses(n) for n, _, _ in prog.inputs if n.startswith("x"))


# Up to this many (query, key) pairs a mask that reads no aux is classified on the host while
# tracing (once per shape, seconds at 64k x 64k on two cores); beyond, the table is computed on
# the device at each call (the same program, traced), which beats minutes of tracing at 1M
# tokens. A `BlockMask` built once (`jaxflash.mods.create_block_mask`) avoids both.
CONSTANT_TABLE_MAX_PAIRS = 2**32


@functools.lru_cache(maxsize=64)
def constant_table(mask_text: str, backward: bool, B: int, N: int, K: int, T: int, S: int,
                   tile_m: int, tile_n: int) -> np.ndarray:
    """The table of a mask that reads no aux (`reads_aux` false), evaluated now (also inside a
    trace) and kept per shape: a host array the caller embeds as a constant."""
    with jax.ensure_compile_time_eval():
        if backward:
            t = backward_table(mask_text, (), B, N, K, T, S, tile_m, tile_n)
        else:
            t = forward_table(mask_text, (), B, N, T, S, tile_m, tile_n)
        return np.asarray(t, np.int32)
