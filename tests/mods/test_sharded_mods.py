"""Mods under batch x head sharding (8 host devices, tests/conftest.py): each shard's mods see
global batch rows and heads, aux is replicated and its gradient summed over the shards, the
block mask is split with the batch / heads it has; results equal the unsharded call's, with
no all-gather."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash
from jaxflash import mods
from tests.common import assert_close, assert_sum_close, fresh_rng, randint, randn


def _score(s, b, h, q_idx, kv_idx, ids, table):
    # reads the batch row and the head: wrong on a shard that saw local indices
    return s + table[jnp.minimum(jnp.abs(q_idx - kv_idx), 15), h] + 0.25 * b.astype(s.dtype)


@pytest.mark.parametrize("explicit,impl", [(False, "xla"), (True, "xla"), (True, "pallas")])
def test_batch_x_heads_sharded_mods_equal_unsharded(explicit, impl):
    """Auto mesh axes: the partitioner splits the call. Explicit axes (sharding in types): the
    call runs per shard under shard_map; the mods must see the same global offsets."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    B, T, N, K, H = 4, 33, 8, 4, 16
    rng = fresh_rng()
    q, k, v, w = (randn((B, T, n, H), "float32", rng) for n in (N, K, K, N))
    ids = jnp.asarray(np.sort(np.asarray(randint(0, 3, (B, T), rng)), axis=1))
    table = randn((16, N), "float32", rng)
    mask = mods.and_masks(mods.causal(), mods.document(0))
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"),
                axis_types=(kind, kind))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))

    def loss(q, k, v, table):
        bm = mods.create_block_mask(mask, B, N, T, T, (16, 32), aux=(ids, table))
        out = jaxflash.flash_attention(q, k, v, implementation=impl, score_mod=_score,
                                       mask_mod=mask, aux=(ids, table), block_mask=bm)
        return jnp.sum(out * w)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    sharded = grad(put(q), put(k), put(v), table)
    # Unsharded: every dim replicated (one shard, offsets 0), the same program otherwise.
    whole = grad(q, k, v, table)
    # The loss sums ~17k terms of both signs and dtable is summed over shards: their own
    # rounding, in another order, bounds them; the per-element gradients match closely.
    # (the loss: bounded by its terms' magnitudes, |out| <= max |v|, not by its own value)
    assert_sum_close(sharded[0], whole[0], np.abs(np.asarray(w)) * float(np.max(np.abs(v))),
                     1e-6, "loss")
    for name, a, b, tol in zip(["dq", "dk", "dv", "dtable"], sharded[1], whole[1],
                               [2e-6, 2e-6, 2e-6, 2e-5]):
        assert_close(np.atleast_1d(a), np.atleast_1d(b), tol, name)
    text = grad.lower(put(q), put(k), put(v), table).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text


@pytest.mark.parametrize("kind", ["mask_mod", "mask_mod_heads", "score_mod"])
def test_cute_mods_partition_under_batch_x_heads_sharding(kind):
    """Lowered for CUDA (no GPU needed): a CuTe call with mods runs per shard (the kernels add
    the shard's offsets, `CuteBackend.shards_mods`), forward and backward: the custom
    partitioning op is there and the kernel sees the shard's q, not the global one."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    pytest.importorskip("cutlass", reason="lowering the CuTe kernels needs the DSL")
    import re
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "h"))
    sh = NamedSharding(mesh, P("b", None, "h", None))
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16, sharding=sh)
    k = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16, sharding=sh)
    kw = {"mask_mod": dict(mask_mod=mods.chunked(512)),
          "mask_mod_heads": dict(mask_mod=lambda b, h, qi, ki: (ki <= qi) & ((h % 2 == 0)
                                                                          | (ki >= qi - 256))),
          "score_mod": dict(score_mod=mods.softcap(20.0), is_causal=True)}[kind]
    f = lambda q, k, v: jnp.sum(jaxflash.flash_attention(q, k, v, **kw).astype(jnp.float32))
    with jaxflash.target_platform("cuda"):
        for fn in (f, jax.grad(f, argnums=(0, 1, 2))):
            text = jax.jit(fn).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
            assert "CustomSPMDPartitioning" in text
            assert not re.search(r"CuteDSLRT\w*\([^\n]*tensor<2x1024x8x128xbf16>", text)


def test_pallas_mods_inside_shard_map():
    """Inside `shard_map` JAX annotates a mod's derivative with `reshard`: the Pallas kernels
    take it as the identity, forward and gradients (aux included) equal the unsharded call's.
    (Pallas calls need `check_vma=False` there: their outputs carry no varying-axes type.)"""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py forces 8 host devices)")
    B, T, N, H = 2, 40, 2, 16
    rng = fresh_rng()
    q, k, v, w = (randn((B, T, N, H), "float32", rng) for _ in range(4))
    slopes = jnp.asarray([0.3, 0.7], jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    # a mod of this test's own (the mods' jaxprs are cached by code: traced first inside
    # shard_map, as here, they carry its annotations)
    bias = lambda s, b, h, qi, ki, sl: s - 0.5 * sl[h] * jnp.abs(qi - ki).astype(s.dtype)

    def loss(q, k, v, slopes):
        out = jaxflash.flash_attention(q, k, v, implementation="pallas", score_mod=bias,
                                       mask_mod=mods.causal(), aux=(slopes,))
        return jnp.sum(out * w), out

    def sharded(q, k, v, slopes):
        def body(q, k, v, slopes, w):
            out = jaxflash.flash_attention(q, k, v, implementation="pallas",
                                           score_mod=bias, mask_mod=mods.causal(),
                                           aux=(slopes,))
            return jax.lax.psum(jnp.sum(out * w), "data"), out
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3 + (P(), P("data")),
                          out_specs=(P(), P("data")), check_vma=False)
        return f(q, k, v, slopes, w)

    part = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, slopes)
    whole = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, slopes)
    assert_close(part[0][1], whole[0][1], 1e-6, "out")
    for name, a, b in zip(["dq", "dk", "dv", "dslopes"], part[1], whole[1]):
        assert_close(a, b, 1e-5, name)


def test_block_mask_of_explicitly_sharded_aux():
    """create_block_mask reads an aux array split over Explicit mesh axes (document ids
    sharded with the batch) whole: the same table as from the unsharded ids."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices)")
    kind = jax.sharding.AxisType.Explicit
    mesh = Mesh(np.array(jax.devices()[:4]), ("b",), axis_types=(kind,))
    rng = fresh_rng()
    ids = jnp.asarray(np.sort(np.asarray(randint(0, 4, (4, 48), rng)), axis=1))
    mask = mods.and_masks(mods.causal(), mods.document(0))
    build = jax.jit(lambda ids: mods.create_block_mask(mask, 4, 1, 48, 48, (16, 16), aux=(ids,)))
    want = build(ids)
    with jax.set_mesh(mesh):
        got = build(jax.device_put(ids, NamedSharding(mesh, P("b"))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
