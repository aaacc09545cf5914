"""Custom attention in the Pallas kernels (interpret mode on CPU): forward, dQ / dK / dV and
the aux gradients against the float32 reference, for every ready-made mod (combined so each
still removes or changes pairs) and two user-written ones; block sparsity (empty tiles
skipped, full tiles run without the mask_mod); the Triton lowering of all of it. GQA and odd
lengths throughout; the interpret tiles are 16 x 32, so several blocks and ragged tails."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mods
from tests.common import FWD_TOL, GRAD_TOL, assert_close, fresh_rng, randint, randn
from tests.mods.helpers import check_rule, faithful

B, N, K, H = 2, 4, 2, 16


def _docs(rng, B, L, ndocs=3):
    """Sorted random document ids [B, L] (packed sequences of random lengths)."""
    cuts = np.sort(rng.integers(1, L, (B, ndocs - 1)), axis=1)
    ids = (np.arange(L)[None, :, None] >= cuts[:, None, :]).sum(-1)
    return jnp.asarray(ids.astype(np.int32))


def _check(T, S, dtype, score_mod, mask_mod, aux, diff, block=None, builtins=None,
           deterministic=False):
    """One jitted program: the kernel's (out, grads of q, k, v and the aux leaves `diff`)
    with and without (the reference) and, for low precision, the faithful reference."""
    rng = fresh_rng()
    q = randn((B, T, N, H), dtype, rng)
    k = randn((B, S, K, H), dtype, rng)
    v = randn((B, S, K, H), dtype, rng)
    w = randn((B, T, N, H), "float32", rng)
    builtins = builtins or {}

    def loss(impl, q, k, v, aux, use_block):
        bm = None
        if use_block:
            bm = mods.create_block_mask(mask_mod, B, 1, T, S, block=block, aux=aux)
        out = jaxflash.flash_attention(q, k, v, implementation=impl, score_mod=score_mod,
                                       mask_mod=mask_mod, aux=aux, block_mask=bm,
                                       deterministic=deterministic, **builtins)
        return jnp.sum(out.astype(jnp.float32) * w), out

    def faithful_loss(q, k, v, aux):
        out = faithful(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux=aux, **builtins)
        return jnp.sum(out.astype(jnp.float32) * w), out

    def grads(f, q, k, v, aux):
        def g(q, k, v, fa):
            full = tuple(fa[diff.index(i)] if i in diff else x for i, x in enumerate(aux))
            return f(q, k, v, full)
        fa = tuple(aux[i] for i in diff)
        (_, out), gr = jax.value_and_grad(g, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, fa)
        return out, gr[:3], tuple(gr[3])

    up = lambda x: x.astype(jnp.float32)

    @jax.jit
    def run(q, k, v, aux):
        kern = grads(lambda *a: loss("pallas", *a, block is not None), q, k, v, aux)
        ref = grads(lambda *a: loss("xla", *a, False), up(q), up(k), up(v), aux)
        fth = grads(faithful_loss, q, k, v, aux) if dtype != "float32" else None
        return kern, ref, fth

    kern, ref, fth = run(q, k, v, aux)
    names = ["out", "dq", "dk", "dv"] + [f"daux{i}" for i in diff]
    flat = lambda r: [r[0], *r[1], *r[2]]
    for i, name in enumerate(names):
        x, r = flat(kern)[i], flat(ref)[i]
        if dtype == "float32":
            assert_close(x, r, FWD_TOL["float32"] if i == 0 else GRAD_TOL["float32"], name)
        elif not name.startswith("daux"):
            check_rule(x, r, flat(fth)[i], name)
    if dtype != "float32" and diff:
        # The aux gradients are a handful of numbers each (a per-head temperature: N of them),
        # so one draw's error ratio is noisy; the rule is applied to them pooled. (Measured over
        # 12 draws of the user-written mods: ours / faithful 0.2-0.6 typically, 1.1 once per
        # leaf; pooled, the tail stays under 1.)
        cat = lambda r: jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in r[3:]])
        check_rule(cat(flat(kern)), cat(flat(ref)), cat(flat(fth)), "daux (pooled)")


@pytest.mark.slow
def test_document_causal_softcap_alibi_bf16_block_sparse():
    """Document masking and causal (a block mask built from them, its 32 x 64 tiles split into
    the kernels' blocks), softcap then learnable ALiBi slopes; bf16, within 1.2x the faithful
    reference's error."""
    rng = fresh_rng()
    T = S = 45
    aux = (_docs(rng, B, S), jnp.abs(randn((N,), "float32", rng)) * 0.3)
    _check(T, S, "bfloat16", mods.chain(mods.softcap(3.0), mods.alibi(1)),
           mods.and_masks(mods.causal(), mods.document(0)), aux, diff=(1,), block=(32, 64))


def test_t5_bias_window_prefix_chunked_f32():
    """T5 relative bias (learnable table) under a sliding window and (prefix-LM or chunked)
    masking, T != S; float32 against the reference's tolerances."""
    rng = fresh_rng()
    T, S = 37, 29
    aux = (randn((32, N), "float32", rng), randint(0, 20, (B,), rng))
    mask = mods.and_masks(mods.sliding_window(9, 4),
                          mods.or_masks(mods.prefix_lm(1), mods.chunked(16)))
    _check(T, S, "float32", mods.t5_bias(0, num_buckets=32, max_distance=24), mask, aux,
           diff=(0,))


def _user_score(score, b, h, q_idx, kv_idx, temp, decay):
    # A learned per-head temperature and a log-distance decay.
    dist = jnp.abs(q_idx - kv_idx).astype(jnp.float32)
    return score * temp[h] - decay[b, h] * jnp.log1p(dist)


def _user_mask(b, h, q_idx, kv_idx, temp, decay):
    # Dilated attention with two global keys: every third key, the first two, and itself.
    return ((q_idx - kv_idx) % 3 == 0) | (kv_idx < 2) | (q_idx == kv_idx)


@pytest.mark.slow
def test_user_written_mods_bf16_block_sparse():
    """Two user-written mods (learnable per-head temperature and per-(batch, head) decay; a
    dilated mask with global keys) under a block mask, with the deterministic backward."""
    rng = fresh_rng()
    T, S = 33, 47
    aux = (1.0 + 0.2 * randn((N,), "float32", rng), jnp.abs(randn((B, N), "float32", rng)))
    _check(T, S, "bfloat16", _user_score, _user_mask, aux, diff=(0, 1), block=(16, 16),
           deterministic=True)


def test_block_mask_skips_empty_tiles_and_the_mask_on_full_ones():
    """A block mask built from chunked attention, run with another mask_mod: the result keeps
    pairs exactly where the block mask's tile is full (mask_mod not evaluated), where it is
    partial and the mask_mod keeps them; nothing of empty tiles (never visited). The mask's
    32 x 64 tiles are several of the kernels' 16 x 32 blocks each."""
    T, S, tm, tn = 70, 75, 32, 64
    chunks = mods.chunked(48)
    parity = lambda b, h, qi, ki: (qi + ki) % 2 == 0
    rng = fresh_rng()
    q, k, v = (randn((B, x, n, H), "float32", rng) for x, n in ((T, N), (S, K), (S, K)))

    @jax.jit
    def run(q, k, v):
        bm = mods.create_block_mask(chunks, 1, 1, T, S, block=(tm, tn))
        out = jaxflash.flash_attention(q, k, v, implementation="pallas", mask_mod=parity,
                                       block_mask=bm)
        return out, bm

    out, bm = run(q, k, v)
    nq, nk = bm.num_blocks
    kind = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        kind[i, np.asarray(bm.full_idx)[0, 0, i, :int(bm.full_count[0, 0, i])]] = 2
        kind[i, np.asarray(bm.partial_idx)[0, 0, i, :int(bm.partial_count[0, 0, i])]] = 1
    assert (kind == 2).any() and (kind == 1).any() and (kind == 0).any()
    t = np.repeat(np.repeat(kind, tm, 0), tn, 1)[:T, :S]
    ii, jj = np.meshgrid(np.arange(T), np.arange(S), indexing="ij")
    dense = (t == 2) | ((t == 1) & ((ii + jj) % 2 == 0))
    want = jax.jit(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, implementation="xla", mask=jnp.asarray(dense)))(q, k, v)
    assert_close(out, want, FWD_TOL["float32"], "out")


def test_create_block_mask_matches_numpy():
    """Counts and ascending index lists of full / partial tiles, and their transposes, per
    (batch, head), against a NumPy classification of the dense mask."""
    rng = fresh_rng()
    T, S, tm, tn = 50, 70, 16, 32
    ids = _docs(rng, 2, 70)
    mm = mods.and_masks(mods.causal(), mods.document(0),
                        lambda b, h, qi, ki, ids: (h == 0) | (ki >= qi - 20))
    bm = jax.jit(lambda ids: mods.create_block_mask(mm, 2, 3, T, S, (tm, tn), aux=(ids,)))(ids)
    ids_np = np.asarray(ids)
    ii, jj = np.meshgrid(np.arange(T), np.arange(S), indexing="ij")
    for b in range(2):
        for h in range(3):
            m = (jj <= ii) & (ids_np[b][ii] == ids_np[b][jj]) & ((h == 0) | (jj >= ii - 20))
            kinds = np.zeros((-(-T // tm), -(-S // tn)), int)
            for i in range(kinds.shape[0]):
                for j in range(kinds.shape[1]):
                    t = m[i * tm:(i + 1) * tm, j * tn:(j + 1) * tn]
                    kinds[i, j] = 2 if t.all() else (1 if t.any() else 0)
            for kind, cnt, idx, cnt_t, idx_t in (
                    (2, bm.full_count, bm.full_idx, bm.full_count_t, bm.full_idx_t),
                    (1, bm.partial_count, bm.partial_idx, bm.partial_count_t,
                     bm.partial_idx_t)):
                for i in range(kinds.shape[0]):
                    want = np.nonzero(kinds[i] == kind)[0]
                    assert int(cnt[b, h, i]) == len(want)
                    assert list(np.asarray(idx[b, h, i, :len(want)])) == list(want)
                for j in range(kinds.shape[1]):
                    want = np.nonzero(kinds[:, j] == kind)[0]
                    assert int(cnt_t[b, h, j]) == len(want)
                    assert list(np.asarray(idx_t[b, h, j, :len(want)])) == list(want)


def test_builtins_and_their_mod_forms_agree_in_the_kernels():
    """is_causal + local_window_size + segment ids + softcap + alibi_slopes against causal,
    sliding_window, document, softcap and alibi mods: the same forward in the Pallas kernels."""
    rng = fresh_rng()
    T = S = 45
    q, k, v = (randn((B, T, n, H), "float32", rng) for n in (N, K, K))
    ids = _docs(rng, B, S)
    slopes = mods.alibi_slopes(N)

    @jax.jit
    def run(q, k, v, ids, slopes):
        a = jaxflash.flash_attention(q, k, v, implementation="pallas", is_causal=True,
                                     local_window_size=(7, 2), q_segment_ids=ids,
                                     kv_segment_ids=ids, softcap=2.0, alibi_slopes=slopes)
        b = jaxflash.flash_attention(
            q, k, v, implementation="pallas",
            mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(7, 2), mods.document(0)),
            score_mod=mods.chain(mods.softcap(2.0), mods.alibi(1)), aux=(ids, slopes))
        return a, b

    a, b = run(q, k, v, ids, slopes)
    assert_close(b, a, 2e-6, "mod forms vs built-ins")


def test_triton_lowering_mods():
    """Every ready-made mod under a block mask: forward and backward lower to the Triton
    custom calls for CUDA (what the H200 compiles), aux gradient in XLA. (Without a block mask
    the kernels differ only in their loops; the GPU test compiles both.)"""
    T = S = 128
    dt = jnp.bfloat16
    q = jax.ShapeDtypeStruct((B, T, N, 64), dt)
    k = jax.ShapeDtypeStruct((B, S, K, 64), dt)
    aux = (jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((N,), jnp.float32),
           jax.ShapeDtypeStruct((32, N), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32))
    mm = mods.and_masks(mods.causal(), mods.document(0), mods.sliding_window(100, 0),
                        mods.or_masks(mods.prefix_lm(3), mods.chunked(64)))
    sm = mods.chain(mods.softcap(30.0), mods.alibi(1), mods.t5_bias(2))

    def loss(q, k, v, aux, sparse):
        bm = mods.create_block_mask(mm, B, 1, T, S, (64, 64), aux=aux) if sparse else None
        out = jaxflash.flash_attention(q, k, v, implementation="pallas", mask_mod=mm,
                                       score_mod=sm, aux=aux, block_mask=bm)
        return jnp.sum(out.astype(jnp.float32))

    with jaxflash.target_platform("cuda"):
        text = jax.jit(jax.grad(lambda *a: loss(*a, True), argnums=(0, 1, 2))).trace(
            q, k, k, aux).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3


def test_builtin_alibi_slope_gradient_matches_the_mod_form_bf16():
    """bf16 in the Pallas kernels: the built-in ALiBi's slope gradient (the dQ kernel's
    per-row partials) equals the mod form's (the aux gradient) to float32 accuracy. Both
    re-center dS per row: delta from the bf16-rounded output leaves each row's dS sum at
    delta's error, which |i - j| would otherwise collect over every query."""
    rng = fresh_rng()
    T, S = 61, 45
    q = randn((B, T, N, H), "bfloat16", rng)
    k = randn((B, S, K, H), "bfloat16", rng)
    w = randn((B, T, N, H), "float32", rng)
    slopes = jnp.abs(randn((N,), "float32", rng)) * 0.3

    def loss(a, builtin):
        kw = (dict(alibi_slopes=a) if builtin else dict(score_mod=mods.alibi(0), aux=(a,)))
        out = jaxflash.flash_attention(q, k, k, implementation="pallas", is_causal=True,
                                       softcap=4.0, **kw)
        return jnp.sum(out.astype(jnp.float32) * w)

    g_builtin, g_mod = jax.jit(lambda a: (jax.grad(loss)(a, True), jax.grad(loss)(a, False)))(
        slopes)
    rel = float(jnp.linalg.norm(g_builtin - g_mod) / jnp.linalg.norm(g_mod))
    assert rel < 1e-4, rel
