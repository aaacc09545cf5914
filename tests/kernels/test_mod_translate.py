"""The mods' translation into kernel programs (`jaxflash.kernels.variants.mod_program`) and the
block range tables (`jaxflash.kernels.mod_blocks`), without the CuTe DSL.

- Every ready-made mod and user-written ones translate; the program, evaluated in NumPy,
  equals the JAX function on random elements (and the score_mod's second output equals
  `jax.grad` by the score); text round-trips.
- What the kernels cannot compute is refused with NotImplementedError naming the primitive.
- The text is the mod's code only: re-created lambdas give the same text, other code another,
  and aux values never enter it.
- The block range tables contain every visible block and mark full only fully visible ones,
  checked block by block against a dense NumPy mask; a `BlockMask` gives the same table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.kernels import mod_blocks
from jaxflash.kernels.variants import mod_program as mp
from jaxflash.mods import library as L
from jaxflash.mods.spec import make_spec


def _kitchen_sink(score, b, h, q_idx, kv_idx, *aux):
    """User-written: most primitives the kernels emit, with negative integer operands."""
    d = q_idx - kv_idx
    a = jnp.abs(d) // 3 + lax_rem(d, 7) + jnp.sign(d)
    x = score * 0.5 + jnp.floor(score) * 0.25 + jnp.round(score / 3.0) + (score ** 2) * 0.01
    y = jax.nn.sigmoid(x) + jnp.sqrt(jnp.abs(x) + 1.0) - jax.lax.rsqrt(x * x + 2.0)
    y = y + jnp.log1p(jnp.abs(score)) + jnp.exp(-jnp.abs(score)) + jnp.expm1(score * 0.01)
    sel = jax.lax.select_n(jnp.clip(d % 3, 0, 2), y, x, -y)
    flag = ((d > 2) & ~(h == 1)) | ((b == 0) ^ (kv_idx < 5))
    z = sel + flag.astype(jnp.float32) + a.astype(jnp.float32) * 0.125 + jnp.exp2(-0.5 * score)
    return jax.lax.clamp(-50.0, z + aux[0][h, jnp.clip(d + 8, 0, 15)], 50.0)


def lax_rem(a, b):
    return jax.lax.rem(a, jnp.int32(b))


def _tbl(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


SCORE_MODS = [
    ("softcap", L.softcap(20.0), lambda r: ()),
    ("alibi", L.alibi(), lambda r: (L.alibi_slopes(8),)),
    ("t5", L.t5_bias(), lambda r: (_tbl(r, 32, 8),)),
    ("t5-causal", L.t5_bias(bidirectional=False), lambda r: (_tbl(r, 32, 8),)),
    ("chain", L.chain(L.softcap(30.0), L.alibi()), lambda r: (L.alibi_slopes(8),)),
    ("kitchen-sink", _kitchen_sink, lambda r: (_tbl(r, 8, 16),)),
]
MASK_MODS = [
    ("causal", L.causal(), lambda r: ()),
    ("window", L.sliding_window(40, 3), lambda r: ()),
    ("chunked", L.chunked(32), lambda r: ()),
    ("document", L.document(), lambda r: (jnp.asarray(np.sort(r.integers(0, 5, (3, 400)), 1)
                                                      .astype(np.int32)),)),
    ("prefix-lm", L.prefix_lm(), lambda r: (jnp.asarray(r.integers(1, 300, 3).astype(
        np.int32)),)),
    ("and-or", L.or_masks(L.and_masks(L.causal(), L.sliding_window(64)),
                          lambda b, h, q, k, *a: (k < 4) | (h == 2)), lambda r: ()),
]


def _elements(rng, n=256):
    return dict(s=rng.standard_normal(n).astype(np.float32) * 4,
                b=rng.integers(0, 3, n).astype(np.int32), h=rng.integers(0, 8, n).astype(np.int32),
                q=rng.integers(0, 400, n).astype(np.int32),
                k=rng.integers(0, 400, n).astype(np.int32))


@pytest.mark.parametrize("name, fn, make_aux", SCORE_MODS, ids=[c[0] for c in SCORE_MODS])
def test_score_programs_match_jax(name, fn, make_aux):
    rng = np.random.default_rng(0)
    aux = make_aux(rng)
    el = _elements(rng)
    prog = mp.score_program(fn, aux, with_grad=True)
    assert mp.parse(mp.to_text(prog)) == prog
    value = jax.jit(jax.vmap(lambda s, b, h, q, k: fn(s, b, h, q, k, *aux)))
    grad = jax.jit(jax.vmap(jax.grad(lambda s, b, h, q, k: fn(s, b, h, q, k, *aux))))
    args = [jnp.asarray(el[n]) for n in "sbhqk"]
    want, dwant = np.asarray(value(*args)), np.asarray(grad(*args))
    auxn = [np.asarray(a) for a in aux]
    got = np.array([mp.evaluate(prog, {n: el[n][i] for n in "sbhqk"}, auxn)
                    for i in range(len(el["s"]))], np.float32)
    np.testing.assert_allclose(got[:, 0], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[:, 1], dwant, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name, fn, make_aux", MASK_MODS, ids=[c[0] for c in MASK_MODS])
def test_mask_programs_match_jax(name, fn, make_aux):
    rng = np.random.default_rng(1)
    aux = make_aux(rng)
    el = _elements(rng)
    prog = mp.mask_program(fn, aux)
    assert mp.parse(mp.to_text(prog)) == prog
    want = np.asarray(jax.jit(jax.vmap(lambda b, h, q, k: fn(b, h, q, k, *aux)))(
        *[jnp.asarray(el[n]) for n in "bhqk"]))
    auxn = [np.asarray(a) for a in aux]
    got = np.array([mp.evaluate(prog, {n: el[n][i] for n in "bhqk"}, auxn)[0]
                    for i in range(len(el["b"]))])
    assert (got == want).all()


def test_negative_index_wrap_folds_away():
    """b, h, q_idx, kv_idx are never negative: jnp indexing's wrap of a negative index (three
    ops per index) leaves nothing in the program."""
    prog = mp.mask_program(L.document(), (jnp.zeros((2, 10), jnp.int32),))
    assert [e.prim for e in prog.eqns] == ["ds", "ds", "eq"]


@pytest.mark.parametrize("fn, prim", [
    (lambda s, b, h, q, k: jnp.sin(s), "sin"),
    (lambda s, b, h, q, k: jnp.cos(s), "cos"),
    (lambda s, b, h, q, k: s + jnp.arange(4.0)[q % 4], "iota"),
    (lambda s, b, h, q, k: s * jax.lax.erf(s), "erf"),
])
def test_untranslatable_is_refused_by_name(fn, prim):
    with pytest.raises(NotImplementedError, match=f"'{prim}'"):
        mp.score_program(fn)


def test_whole_aux_and_closures_are_refused():
    t = jnp.ones((4, 4), jnp.float32)
    with pytest.raises(NotImplementedError, match="aux"):
        mp.score_program(lambda s, b, h, q, k, a: s + a.sum(), (t,))
    with pytest.raises(NotImplementedError, match="aux"):
        mp.score_program(lambda s, b, h, q, k: s + t[h % 4, q % 4])


def test_cute_backend_refuses_with_the_primitive(monkeypatch):
    """Dispatch: `implementation="cute"` with an untranslatable score_mod names the primitive
    (and `explain` reports it: the next backend runs)."""
    import jaxflash
    monkeypatch.setenv("JAXFLASH_CUTE_UNVERIFIED", "1")
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    with jaxflash.target_platform("cuda"):
        text = str(jaxflash.explain(q, q, q, score_mod=lambda s, b, h, qi, ki: jnp.sin(s)))
    assert "'sin'" in text and "cute" in text


def test_text_is_the_code_not_the_aux_values():
    rng = np.random.default_rng(2)
    t1, t2 = _tbl(rng, 32, 8), _tbl(rng, 32, 8)
    a = mp.to_text(mp.score_program(L.t5_bias(), (t1,)))
    assert a == mp.to_text(mp.score_program(L.t5_bias(), (t2,)))  # new values: same kernel
    assert a == mp.to_text(mp.score_program(lambda s, b, h, q, k, t: L.t5_bias()(
        s, b, h, q, k, t), (t1,)))                                # a re-created function
    assert a != mp.to_text(mp.score_program(L.t5_bias(max_distance=64), (t1,)))
    assert a != mp.to_text(mp.score_program(L.t5_bias(), (_tbl(rng, 16, 8),)))  # aux shape
    spec1, _ = make_spec(L.softcap(20.0), None, ())
    spec2, _ = make_spec(L.softcap(30.0), None, ())
    assert mp.spec_texts(spec1)["score"] != mp.spec_texts(spec2)["score"]


def _dense_mask(fn, aux, B, N, T, S):
    b, h, q, k = np.meshgrid(np.arange(B), np.arange(N), np.arange(T), np.arange(S),
                             indexing="ij")
    f = jax.jit(lambda *a: fn(*a, *aux))
    return np.asarray(f(*[jnp.asarray(x, jnp.int32) for x in (b, h, q, k)]))


def _check_table(table, dense, rows_tile, cols_tile, rows_are_keys, group=1, full=None):
    """Every visible block of `dense` inside [lo, hi); every block in [full_lo, full_hi)
    fully visible in `full` (default `dense`; elements past T / S do not count)."""
    full = dense if full is None else full
    if rows_are_keys:
        dense, full = np.swapaxes(dense, -1, -2), np.swapaxes(full, -1, -2)
    B, N = dense.shape[:2]
    R, C = dense.shape[2:]
    for b in range(B):
        for n in range(N):
            row = table[min(b, table.shape[0] - 1), min(n // group, table.shape[1] - 1)]
            for i in range(-(-R // rows_tile)):
                lo, flo, fhi, hi = row[i]
                assert lo <= flo <= fhi <= hi or (lo == hi == 0), row[i]
                for j in range(-(-C // cols_tile)):
                    blk = dense[b, n, i * rows_tile:(i + 1) * rows_tile,
                                j * cols_tile:(j + 1) * cols_tile]
                    if blk.any():
                        assert lo <= j < hi, (b, n, i, j, row[i])
                    if flo <= j < fhi:
                        assert full[b, n, i * rows_tile:(i + 1) * rows_tile,
                                    j * cols_tile:(j + 1) * cols_tile].all(), (b, n, i, j)


@pytest.mark.parametrize("name, fn, make_aux", MASK_MODS, ids=[c[0] for c in MASK_MODS])
def test_block_tables_cover_the_mask(name, fn, make_aux):
    rng = np.random.default_rng(3)
    aux = make_aux(rng)
    B, N, K, T, S = 3, 4, 2, 300, 333
    text = mp.to_text(mp.mask_program(fn, aux))
    dense = _dense_mask(fn, aux, B, N, T, S)
    fwd = np.asarray(mod_blocks.forward_table(text, aux, B, N, T, S, 64, 32))
    _check_table(fwd, dense, 64, 32, False)
    bwd = np.asarray(mod_blocks.backward_table(text, aux, B, N, K, T, S, 64, 32))
    # the backward's rows: visible for some query head of the KV head's group, full for all
    grouped = dense.reshape(B, K, N // K, T, S)
    union = np.repeat(grouped.any(2), N // K, axis=1)
    inter = np.repeat(grouped.all(2), N // K, axis=1)
    _check_table(bwd, union, 32, 64, True, group=N // K, full=inter)
    # a BlockMask with the forward's blocks gives the forward's table
    from jaxflash.mods.block_mask import create_block_mask
    bm = create_block_mask(fn, B, N, T, S, block=(64, 32), aux=aux)
    got = np.asarray(mod_blocks.table_from_block_mask(bm, 64, 32, False, N, K, -(-S // 32)))
    want = np.broadcast_to(fwd, got.shape)
    assert (got == want).all()


def test_program_evaluated_in_xla_matches_numpy():
    """`mod_blocks.evaluate` (the tables' evaluator) agrees with the NumPy evaluator."""
    rng = np.random.default_rng(4)
    aux = (_tbl(rng, 8, 16),)
    prog = mp.score_program(_kitchen_sink, aux, with_grad=True)
    el = _elements(rng, 64)
    got = mod_blocks.evaluate(prog, {n: jnp.asarray(el[n]) for n in "sbhqk"}, aux)
    want = np.array([mp.evaluate(prog, {n: el[n][i] for n in "sbhqk"}, [np.asarray(aux[0])])
                     for i in range(64)], np.float32)
    np.testing.assert_allclose(np.asarray(got[0]), want[:, 0], rtol=2e-5, atol=2e-5)


def test_block_tables_of_a_shard_use_global_indices():
    """A shard (batch rows 1.., heads 2..) gets the rows of the whole call's table: the mods
    see global (batch, head) indices through `arrays.mod_offsets`."""
    fn = lambda b, h, q, k: (q + 40 * h + 7 * b) >= k
    text = mp.to_text(mp.mask_program(fn))
    whole = np.asarray(mod_blocks.forward_table(text, (), 3, 4, 200, 200, 64, 32))
    shard = np.asarray(mod_blocks.forward_table(text, (), 2, 2, 200, 200, 64, 32,
                                                jnp.array([1, 2], jnp.int32)))
    assert (shard == whole[1:3, 2:4]).all()


def test_aux_free_masks_get_a_constant_table_once_per_shape():
    """A mask_mod that reads no aux (causal, a window) has its table computed once, while
    tracing, equal to the per-call one; a mask that reads aux does not qualify."""
    from jaxflash.mods import library as L
    causal = mp.to_text(mp.mask_program(L.causal()))
    window = mp.to_text(mp.mask_program(L.sliding_window(40, 3)))
    docs = jnp.asarray(np.repeat(np.arange(3), 100)[None], jnp.int32)
    document = mp.to_text(mp.mask_program(L.document(), (docs,)))
    assert not mod_blocks.reads_aux(causal) and not mod_blocks.reads_aux(window)
    assert mod_blocks.reads_aux(document)
    for text in (causal, window):
        for backward in (False, True):
            args = (text, backward, 2, 4, 2, 300, 333, 64, 32)
            mod_blocks.constant_table.cache_clear()

            @jax.jit
            def traced(_):   # computed while tracing: a constant, not a program
                return jnp.asarray(mod_blocks.constant_table(*args))

            got = np.asarray(traced(0))
            assert "while" not in jax.jit(traced).lower(0).as_text()
            want = (mod_blocks.backward_table(text, (), 2, 4, 2, 300, 333, 64, 32) if backward
                    else mod_blocks.forward_table(text, (), 2, 4, 300, 333, 64, 32))
            assert (got == np.asarray(want)).all()
            assert mod_blocks.constant_table.cache_info().misses == 1
            mod_blocks.constant_table(*args)
            assert mod_blocks.constant_table.cache_info().hits >= 1


@pytest.mark.parametrize("T,S,block,tile,backward,N,K", [
    (96, 160, (32, 32), (32, 32), False, 4, 2),     # the kernel's tiles are the mask's blocks
    (96, 192, (64, 64), (64, 32), False, 4, 2),     # each key block is two kernel blocks
    (128, 160, (64, 32), (32, 32), True, 4, 2),     # backward: query blocks split in two
    (90, 150, (64, 32), (32, 32), True, 4, 2),      # a ragged end: derived, not scaled
    (96, 160, (32, 32), (32, 32), True, 4, 2),      # per-head mask, GQA union: derived
])
def test_kept_ranges_equal_the_derived_table(T, S, block, tile, backward, N, K):
    """A BlockMask keeps its range tables (`BlockMask.ranges`, `.ranges_t`); the kernel table
    taken from them is the one derived from its lists, whenever it is taken."""
    import dataclasses
    from jaxflash import mods
    rng = np.random.default_rng(11)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, max(T, S))), axis=1).astype(np.int32))
    fn = mods.and_masks(mods.causal(), mods.document(0),
                        lambda b, h, q, k, ids: (h % 2 == 0) | (k >= q - 40))
    bm = mods.create_block_mask(fn, 2, N, T, S, block=block, aux=(ids,))
    assert bm.ranges.shape == bm.full_count.shape + (4,)
    assert bm.ranges_t.shape == bm.full_count_t.shape + (4,)
    rows, cols = (tile[1], tile[0]) if backward else tile
    n_cols = -(-(T if backward else S) // cols)
    kept = mod_blocks.table_from_block_mask(bm, rows, cols, backward, N, K, n_cols)
    bare = dataclasses.replace(bm, ranges=None, ranges_t=None)
    derived = mod_blocks.table_from_block_mask(bare, rows, cols, backward, N, K, n_cols)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(derived))
