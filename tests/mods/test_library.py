"""The ready-made mods mean what they say: each against an independent NumPy dense mask or
bias passed to the reference, and the built-in arguments against their mod forms (the
reference; the kernels' agreement is in test_pallas_mods). One jitted program for all."""
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import mods
from tests.common import assert_close, fresh_rng, randint, randn

B, T, S, N, K, H = 2, 29, 37, 4, 2, 16


def _t5_bucket_np(rel, num_buckets, max_distance, bidirectional):
    # T5's relative_position_bucket (Raffel et al.), in NumPy.
    ret = np.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret += (rel > 0) * n
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    exact = n // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(np.maximum(rel, 1) / exact) / math.log(max_distance / exact)
                         * (n - exact)).astype(rel.dtype)
    return ret + np.where(rel < exact, rel, np.minimum(large, n - 1))


def test_ready_made_mods_against_numpy_and_builtins():
    rng = fresh_rng()
    q, k, v = (randn((B, x, n, H), "float32", rng) for x, n in ((T, N), (S, K), (S, K)))
    ids = jnp.asarray(np.sort(np.asarray(randint(0, 3, (B, S), rng)), axis=1))
    prefix = randint(0, S, (B,), rng)
    slopes = jnp.abs(randn((N,), "float32", rng))
    table = randn((32, N), "float32", rng)
    ii, jj = np.meshgrid(np.arange(T), np.arange(S), indexing="ij")
    ids_np, pre_np = np.asarray(ids), np.asarray(prefix)
    bucket = _t5_bucket_np(jj - ii, 32, 128, True)
    bucket_uni = _t5_bucket_np(jj - ii, 32, 128, False)
    dense_masks = {
        "causal": (mods.causal(), (), jj <= ii),
        "window": (mods.sliding_window(5, 3), (), (jj >= ii - 5) & (jj <= ii + 3)),
        "chunked": (mods.chunked(8), (), ii // 8 == jj // 8),
        "document": (mods.document(0), (ids,), ids_np[:, ii] == ids_np[:, jj]),
        "prefix_lm": (mods.prefix_lm(0), (prefix,), (jj <= ii) | (jj < pre_np[:, None, None])),
    }
    # score mods: (mod, aux, dense bias [.., T, S] in logit units, softcap applied to logits)
    dense_scores = {
        "alibi": (mods.alibi(0), (slopes,),
                  -np.asarray(slopes)[:, None, None] * np.abs(ii - jj)),
        "t5": (mods.t5_bias(0), (table,), np.moveaxis(np.asarray(table)[bucket], -1, 0)),
        "t5_unidirectional": (mods.t5_bias(0, bidirectional=False), (table,),
                              np.moveaxis(np.asarray(table)[bucket_uni], -1, 0)),
    }

    @jax.jit
    def run(q, k, v, ids, prefix, slopes, table):
        fa = lambda **kw: jaxflash.flash_attention(q, k, v, implementation="xla", **kw)
        out = {}
        for name, (m, aux, dm) in dense_masks.items():
            dm = jnp.asarray(dm if dm.ndim == 3 else dm[None])[:, None]
            out[name] = (fa(mask_mod=m, aux=aux), fa(mask=dm))
        for name, (m, aux, bias) in dense_scores.items():
            out[name] = (fa(score_mod=m, aux=aux), fa(bias=jnp.asarray(bias, jnp.float32)))
        out["softcap"] = (fa(score_mod=mods.softcap(0.5)), fa(softcap=0.5))
        # Built-ins against their mod forms, all at once.
        out["builtins"] = (
            fa(mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(6, 1)),
               score_mod=mods.chain(mods.softcap(1.5), mods.alibi(0)), aux=(slopes,)),
            fa(is_causal=True, local_window_size=(6, 1), softcap=1.5, alibi_slopes=slopes))
        out["segments"] = (fa(mask_mod=mods.document(0), aux=(ids[:, :S],)),
                           fa(q_segment_ids=ids[:, :T], kv_segment_ids=ids))
        # or_masks / and_masks / chain compose as stated.
        out["or"] = (fa(mask_mod=mods.or_masks(mods.causal(), mods.chunked(8))),
                     fa(mask=jnp.asarray((jj <= ii) | (ii // 8 == jj // 8))))
        return out

    for name, (got, want) in run(q, k, v, ids, prefix, slopes, table).items():
        assert_close(got, want, 1e-6, name)


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9), rtol=1e-6)
    s12 = np.asarray(mods.alibi_slopes(12))
    np.testing.assert_allclose(s12[:8], 2.0 ** -np.arange(1, 9), rtol=1e-6)
    np.testing.assert_allclose(s12[8:], 2.0 ** -(np.arange(4) + 0.5), rtol=1e-6)


def test_block_mask_is_a_pytree_that_jit_passes_through():
    ids = jnp.asarray(np.repeat(np.arange(4), 16)[None].astype(np.int32))
    bm = jax.jit(lambda ids: mods.create_block_mask(mods.document(0), 1, 1, 64, 64, (16, 16),
                                                    aux=(ids,)))(ids)
    assert bm.block == (16, 16) and bm.seq_lens == (64, 64)
    leaves, tree = jax.tree_util.tree_flatten(bm)
    assert len(leaves) == 10 and jax.tree_util.tree_unflatten(tree, leaves).block == (16, 16)
    # four documents of one tile each: the diagonal tiles are full, the rest empty
    assert np.asarray(bm.full_count).tolist() == [[[1, 1, 1, 1]]]
    assert np.asarray(bm.partial_count).sum() == 0
    assert float(bm.density()[0, 0]) == 0.25
