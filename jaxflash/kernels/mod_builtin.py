"""A mask_mod that is one of the built-in masks, recognized by evaluating it.

A mask_mod that reads no aux array and ignores the batch and head indices is one fixed T x S
pattern. When that pattern is exactly a built-in's (causal, a sliding window, both, or no mask
at all), the call runs the built-in instead: the result is the same bit for bit (the pattern
is compared with the built-in's row by row for the call's shape), and the call gets the
built-in's schedules (paired causal tiles, the short-window loop) and no per-element program on
its partial tiles. `builtin_form` evaluates the program once per (program, T, S), while
tracing, in row blocks; above `MAX_ELEMENTS` (T x S) it does not try, and the mod runs as
written (same result, the mod path's speed).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash.kernels.mod_blocks import evaluate
from jaxflash.kernels.variants.mod_program import parse

MAX_ELEMENTS = 1 << 28  # 16k x 16k: a few seconds on one CPU core, once per shape
_BLOCK_ELEMENTS = 1 << 22  # elements evaluated per row block
_DTYPES = {"f32": jnp.float32, "i32": jnp.int32, "bool": jnp.bool_}


@functools.lru_cache(maxsize=64)
def builtin_form(mask_text: str, T: int, S: int) -> Optional[tuple[bool, Optional[tuple]]]:
    """``(is_causal, window)`` of the built-in mask equal to the program's on ``[0, T) x
    [0, S)`` (``window`` None or ``(left, right)``, `jaxflash.masking.keep`'s meaning; ``(False,
    None)``: every pair visible), or None when it is no built-in or cannot be told here."""
    prog = parse(mask_text)
    if any(prog.uses(n) for n, _, _ in prog.inputs if n in ("b", "h") or n.startswith("x")):
        return None
    if T <= 0 or S <= 0 or T * S > MAX_ELEMENTS:
        return None
    with jax.ensure_compile_time_eval():
        lo, hi, cnt = _row_stats(mask_text, T, S)
    return _match(lo, hi, cnt, T, S)


def _row_stats(mask_text: str, T: int, S: int):
    """Per query row: first and last visible key (S / -1 when none) and the visible count."""
    R = max(1, min(T, _BLOCK_ELEMENTS // S))
    f = _stats_fn(mask_text, R, S)
    parts = [f(jnp.int32(r0)) for r0 in range(0, T, R)]
    lo, hi, cnt = (np.concatenate([np.asarray(p[i]) for p in parts])[:T] for i in range(3))
    return lo, hi, cnt


@functools.lru_cache(maxsize=16)
def _stats_fn(mask_text: str, R: int, S: int):
    prog = parse(mask_text)

    @jax.jit
    def f(r0):
        q = r0 + jnp.arange(R, dtype=jnp.int32)[:, None]
        k = jnp.arange(S, dtype=jnp.int32)[None, :]
        zero = jnp.zeros((), jnp.int32)
        # aux inputs the mask does not read (`builtin_form` checked): placeholders
        aux = tuple(jnp.zeros(shape, _DTYPES[dt]) for n, dt, shape in prog.inputs
                    if n.startswith("x"))
        vis, = evaluate(prog, {"b": zero, "h": zero, "q": q, "k": k}, aux)
        vis = jnp.broadcast_to(vis.astype(bool), (R, S))
        cnt = vis.sum(axis=1, dtype=jnp.int32)
        first = jnp.argmax(vis, axis=1).astype(jnp.int32)
        last = (S - 1 - jnp.argmax(vis[:, ::-1], axis=1)).astype(jnp.int32)
        return jnp.where(cnt > 0, first, S), jnp.where(cnt > 0, last, -1), cnt
    return f


def _match(lo, hi, cnt, T: int, S: int):
    rows = np.arange(T)
    seen = cnt > 0
    if not np.array_equal(cnt[seen], hi[seen] - lo[seen] + 1):
        return None  # a row's visible keys are not one run
    # The bounds the rows that are not clipped at a sequence end show (unbounded: every row is)
    r_rows, l_rows = seen & (hi < S - 1), seen & (lo > 0)
    right = int((hi - rows)[r_rows].max()) if r_rows.any() else S
    left = int((rows - lo)[l_rows].max()) if l_rows.any() else T
    if left < 0 or right < 0:
        return None  # the window would exclude the diagonal: not a built-in form
    lo_b, hi_b = np.maximum(0, rows - left), np.minimum(S - 1, rows + right)
    want = np.maximum(0, hi_b - lo_b + 1)
    if not (np.array_equal(cnt, want) and np.array_equal(lo[seen], lo_b[seen])
            and np.array_equal(hi[seen], hi_b[seen])):
        return None
    left_free, right_free = left >= T - 1, right >= S - 1
    if right == 0:  # k <= q: causal, with the left bound if there is one
        return True, (None if left_free else (left, 0))
    if left_free and right_free:
        return False, None
    return False, (min(left, T), min(right, S))
