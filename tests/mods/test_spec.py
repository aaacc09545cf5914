"""The mods' interface: the key follows the code and never the aux values, changing aux
never recompiles, what cannot be served is refused with its reason, and mistakes are
ValueErrors that say what to do."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mods
from tests.common import fresh_rng, randn

_Q = jax.ShapeDtypeStruct((2, 24, 4, 64), jnp.bfloat16)
_K = jax.ShapeDtypeStruct((2, 24, 2, 64), jnp.bfloat16)


def _key(score=None, mask=None, aux=()):
    return mods.make_spec(score, mask, aux)[0].key


def test_key_follows_code_not_aux_values():
    a = jnp.ones((4,), jnp.float32)
    b = jnp.arange(4, dtype=jnp.float32)
    # The same code built twice (two closures), other aux values: one key.
    assert _key(mods.alibi(), aux=(a,)) == _key(mods.alibi(), aux=(b,))
    assert mods.make_spec(mods.alibi(), None, (a,))[0] == mods.make_spec(mods.alibi(), None,
                                                                          (b,))[0]
    # Other code, another constant compiled in, another aux shape or dtype: another key.
    assert _key(mods.alibi(), aux=(a,)) != _key(mods.chain(mods.alibi(), mods.softcap(5.0)),
                                                aux=(a,))
    assert _key(mods.softcap(5.0)) != _key(mods.softcap(6.0))
    assert _key(mods.alibi(), aux=(a,)) != _key(mods.alibi(), aux=(jnp.ones((8,)),))
    assert _key(mods.alibi(), aux=(a,)) != _key(mods.alibi(), aux=(a.astype(jnp.int32),))
    # a bf16 leaf is read in float32 (as the kernels compute): the same program
    assert _key(mods.alibi(), aux=(a,)) == _key(mods.alibi(), aux=(a.astype(jnp.bfloat16),))
    assert _key(mask=mods.causal()) != _key(mask=mods.sliding_window(4, 0))
    # A mod's role is part of the key.
    assert _key(mask=mods.causal()) != _key(score=mods.softcap(5.0), mask=mods.causal())


def test_jaxprs_on_scalars():
    spec, leaves = mods.make_spec(mods.t5_bias(), mods.document(1),
                                  (jnp.zeros((32, 4)), jnp.zeros((2, 24), jnp.int32)))
    sj, dj, mj = mods.score_jaxpr(spec), mods.score_deriv_jaxpr(spec), mods.mask_jaxpr(spec)
    assert [v.aval.shape for v in sj.jaxpr.invars] == [(), (), (), (), (), (32, 4), (2, 24)]
    assert [str(v.aval.dtype) for v in sj.jaxpr.invars[:5]] == ["float32"] + ["int32"] * 4
    assert len(dj.jaxpr.outvars) == 2 and mj.jaxpr.outvars[0].aval.dtype == jnp.bool_
    assert len(mj.jaxpr.invars) == 6
    assert spec.aux(leaves)[1] is leaves[1]


def test_changing_aux_never_recompiles():
    """One compile for three aux values (the Pallas kernels' forward; the gradients are in the
    same program when differentiated, nothing there depends on the values either)."""
    rng = fresh_rng()
    q = randn((1, 17, 2, 16), "float32", rng)
    k = randn((1, 17, 2, 16), "float32", rng)

    @jax.jit
    def f(q, k, table):
        return jaxflash.flash_attention(
            q, k, k, implementation="pallas", score_mod=mods.t5_bias(0, num_buckets=8),
            mask_mod=mods.causal(), aux=(table,))

    outs = [f(q, k, randn((8, 2), "float32", rng)) for _ in range(3)]
    assert f._cache_size() == 1
    assert not np.allclose(outs[0], outs[1])   # the values did reach the kernels


def test_explain_names_who_cannot_serve_mods():
    """On CUDA the CuTe kernels serve mods (translated into the kernels, checked on the H200);
    cuDNN refuses them by name; a mod the kernels cannot translate falls to Pallas, and explain
    says why."""
    with jaxflash.target_platform("cuda"):
        # (chunks: no built-in mask, so the mask_mod stays one; a causal mask_mod would run
        # as is_causal, `test_builtin_form`)
        plan = jaxflash.explain(_Q, _K, _K, score_mod=mods.softcap(5.0), mask_mod=mods.chunked(4))
        text = str(plan)
        assert plan.backend == "cute" and "FlashBwdSm90" in text, text
        assert "score_mod" in plan.problem.features() and "mask_mod" in plan.problem.features()
        assert "aux gradients" not in text   # no aux leaf to differentiate
        # a learnable aux: explain says how its gradient is taken
        slopes = jax.ShapeDtypeStruct((_Q.shape[2],), jnp.float32)
        text = str(jaxflash.explain(_Q, _K, _K, score_mod=mods.alibi(0), aux=(slopes,)))
        assert "'cute' runs" in text and "aux gradients: XLA, blockwise" in text, text
        cudnn = str(jaxflash.explain(_Q, _K, _K, mask_mod=mods.chunked(4), implementation="cudnn"))
        assert "'cudnn' refused: score_mod / mask_mod" in cudnn, cudnn
        # a cumulative sum has no kernel translation: Pallas runs, and cute's refusal is named
        odd = lambda s, b, h, qi, ki: s + jnp.cumsum(jnp.ones(3))[1]
        plan = jaxflash.explain(_Q, _K, _K, score_mod=odd)
        text = str(plan)
    assert plan.backend in ("pallas", "xla") and "'cute' refused: " in text, text


def test_pallas_refuses_what_it_cannot_translate():
    row_sum = lambda s, b, h, qi, ki, t: s + jnp.sum(t[h, :])     # a non-scalar read
    plan = jaxflash.explain(_Q, _K, _K, score_mod=row_sum, aux=(jnp.zeros((4, 8)),),
                            implementation="pallas")
    assert plan.backend is None and "['reduce_sum']" in str(plan), str(plan)
    with pytest.raises(NotImplementedError, match="reduce_sum"):
        jaxflash.flash_attention(jnp.zeros(_Q.shape), jnp.zeros(_K.shape), jnp.zeros(_K.shape),
                                 score_mod=row_sum, aux=(jnp.zeros((4, 8)),),
                                 implementation="pallas")
    flags = lambda b, h, qi, ki, f: f[ki]
    plan = jaxflash.explain(_Q, _K, _K, mask_mod=flags, aux=(jnp.ones((24,), bool),),
                            implementation="pallas")
    assert plan.backend is None and "boolean aux" in str(plan)
    assert jaxflash.explain(_Q, _K, _K, mask_mod=flags, aux=(jnp.ones((24,), bool),)).backend \
        == "xla"
    # a loop is not a call: its body replayed once would compute something else, so a mod with
    # `fori_loop` / `scan` is refused by name in both kernel translators
    loop = lambda s, b, h, qi, ki: jax.lax.fori_loop(0, 3, lambda i, x: 0.9 * x + 0.01, s)
    plan = jaxflash.explain(_Q, _K, _K, score_mod=loop, implementation="pallas")
    assert plan.backend is None and "['scan']" in str(plan), str(plan)
    with jaxflash.target_platform("cuda"):
        text = str(jaxflash.explain(_Q, _K, _K, score_mod=loop))
        assert "'xla' runs" in text and "'scan'" in text, text
    # whole-array work on aux (no per-element operand) is refused too, by the operation's name,
    # and so is an array the mod closes over (a kernel takes arrays only as operands)
    for mod, why in ((lambda s, b, h, qi, ki, t: s + jnp.sort(t)[h], "['sort']"),
                     (lambda s, b, h, qi, ki, t: s + jax.lax.erf(s), "['erf']"),
                     (lambda s, b, h, qi, ki, t: s + jnp.asarray(np.arange(4.0))[h],
                      "array constants of shapes [(4,)]")):
        plan = jaxflash.explain(_Q, _K, _K, score_mod=mod, aux=(jnp.zeros((4,)),),
                                implementation="pallas")
        assert plan.backend is None and why in str(plan), str(plan)
        with jaxflash.target_platform("cuda"):
            assert "'pallas' refused" in str(jaxflash.explain(_Q, _K, _K, score_mod=mod,
                                                              aux=(jnp.zeros((4,)),)))


def test_mistakes_are_value_errors():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="through aux"):
        jax.jit(lambda q, t: jaxflash.flash_attention(
            q, q, q, score_mod=lambda s, b, h, i, j: s + t[h]))(q, jnp.ones(2))
    with pytest.raises(ValueError, match="boolean scalar"):
        jaxflash.flash_attention(q, q, q, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(ValueError, match="floating scalar"):
        jaxflash.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j: i > j)
    with pytest.raises(ValueError, match="aux was given"):
        jaxflash.flash_attention(q, q, q, aux=(jnp.ones(2),))
    bm = mods.create_block_mask(mods.causal(), 1, 1, 8, 8, block=(16, 16))
    with pytest.raises(ValueError, match="needs the mask_mod"):
        jaxflash.flash_attention(q, q, q, block_mask=bm)
    q9 = jnp.zeros((1, 9, 2, 16))
    with pytest.raises(ValueError, match=r"built for \(T, S\) = \(8, 8\)"):
        jaxflash.flash_attention(q9, q9, q9, mask_mod=mods.causal(), block_mask=bm)
    with pytest.raises(ValueError, match="power of two"):
        mods.create_block_mask(mods.causal(), 1, 1, 8, 8, block=(24, 16))


def test_a_block_mask_for_one_batch_or_head_must_not_be_shared_by_a_mask_that_reads_it():
    """A block mask built with B = 1 (H = 1) broadcasts over the call's batch (heads) only
    when the mask_mod reads neither index: otherwise its tiles are another element's, and the
    call would skip or run unmasked the wrong tiles."""
    rng = fresh_rng()
    B, T, N = 2, 64, 2
    q = randn((B, T, N, 16), "float32", rng)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32))
    by_head = lambda b, h, i, j: (h == 0) | (j <= i)
    for mm, aux, dims, match in ((mods.document(0), (ids,), (1, 1), "reads 'b'"),
                                 (by_head, (), (1, 1), "reads 'h'")):
        bm = mods.create_block_mask(mm, *dims, T, T, block=(16, 16), aux=aux)
        with pytest.raises(ValueError, match=match):
            jaxflash.flash_attention(q, q, q, mask_mod=mm, aux=aux, block_mask=bm)
    # built per batch element / head, or for a mask reading neither: accepted
    bm = mods.create_block_mask(mods.document(0), B, 1, T, T, block=(16, 16), aux=(ids,))
    jaxflash.flash_attention(q, q, q, mask_mod=mods.document(0), aux=(ids,), block_mask=bm)
    bm = mods.create_block_mask(mods.causal(), 1, 1, T, T, block=(16, 16))
    jaxflash.flash_attention(q, q, q, mask_mod=mods.causal(), block_mask=bm)


def test_python_numbers_from_mods_and_non_numeric_aux():
    """A mod may return a Python number (a constant logit, True); an aux leaf that is no
    numeric or boolean array is a ValueError naming it."""
    rng = fresh_rng()
    q = randn((1, 20, 2, 16), "float32", rng)
    mean = jnp.broadcast_to(jnp.mean(q, axis=1, keepdims=True), q.shape)
    for impl in ("xla", "pallas"):
        out = jaxflash.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j: 0.0,
                                       mask_mod=lambda b, h, i, j: True, implementation=impl)
        np.testing.assert_allclose(np.asarray(out), np.asarray(mean), atol=1e-6)
    with pytest.raises(ValueError, match="aux leaves must be numeric"):
        jaxflash.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j, a: s, aux=("abc",))


TEMPERATURE = 1.0   # a module constant a mod reads (test_a_changed_constant_is_new_code)


def _tempered(score, b, h, q_idx, kv_idx):
    return score * TEMPERATURE


def test_a_changed_constant_is_new_code():
    """A Python constant a mod reads (a module global, a closure's number, through composed
    mods too) is part of its code: changing it between eager calls gives the new result under
    a new key, never the old trace."""
    global TEMPERATURE
    from jaxflash.mods.spec import make_spec
    q = randn((1, 24, 2, 16), "float32", fresh_rng())
    try:
        TEMPERATURE = 1.0
        a = jaxflash.flash_attention(q, q, q, score_mod=mods.chain(_tempered, mods.softcap(5.0)))
        k1 = make_spec(mods.chain(_tempered, mods.softcap(5.0)), None, ())[0].key
        TEMPERATURE = 0.0
        b = jaxflash.flash_attention(q, q, q, score_mod=mods.chain(_tempered, mods.softcap(5.0)))
        k2 = make_spec(mods.chain(_tempered, mods.softcap(5.0)), None, ())[0].key
    finally:
        TEMPERATURE = 1.0
    assert k1 != k2
    mean = jnp.broadcast_to(jnp.mean(q, axis=1, keepdims=True), q.shape)
    np.testing.assert_allclose(np.asarray(b), np.asarray(mean), atol=1e-6)   # score * 0
    assert not np.allclose(np.asarray(a), np.asarray(b))


class _Temper:
    def __init__(self, c):
        self.c = c

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.c


def test_changed_values_reached_through_methods_arrays_and_masks():
    """The values a mod reads through a callable object, a NumPy array changed in place and
    a composed mask's closure are part of its key as well."""
    from jaxflash.mods.spec import make_spec
    key = lambda sm=None, mm=None: make_spec(sm, mm, ())[0].key
    t = _Temper(1.0)
    k1 = key(sm=t)
    t.c = 0.5
    assert key(sm=t) != k1
    table = np.zeros(4, np.float32)
    sm = lambda s, b, h, i, j: s + table[0]
    k1 = key(sm=sm)
    table[0] = 1.0
    assert key(sm=sm) != k1
    class Cfg:
        c = 1.0
    sm = lambda s, b, h, i, j: (lambda x: x * Cfg.c)(s)   # a class attribute, one lambda deep
    k1 = key(sm=sm)
    Cfg.c = 2.0
    assert key(sm=sm) != k1
    limit = [4]
    lim = lambda b, h, i, j: j < limit[0]
    mm = mods.and_masks(mods.causal(), lim)
    k1 = key(mm=mm)
    limit[0] = 6
    assert key(mm=mm) != k1
