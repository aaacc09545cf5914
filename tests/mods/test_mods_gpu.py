"""The mods on a CUDA GPU: the Pallas kernels compiled by Triton (gather loads of aux arrays,
block-mask lists), forward and gradients (q, k, v and aux) within 1.2x the dtype-faithful
reference's error; and, where the CuTe kernels serve mods, the same through them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mods
from tests.common import fresh_rng, randn
from tests.mods.helpers import check_rule, faithful

pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 300, 333, 4, 2, 64


def _docs(rng):
    cuts = np.sort(rng.integers(1, S, (B, 3)), axis=1)
    return jnp.asarray((np.arange(S)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32))


CASES = {
    "document_causal_alibi_block": lambda rng: (
        mods.alibi(1), mods.and_masks(mods.causal(), mods.document(0)),
        (_docs(rng), jnp.abs(randn((N,), "float32", rng)) * 0.1), (1,), True),
    "t5_window_softcap": lambda rng: (
        mods.chain(mods.softcap(20.0), mods.t5_bias(0)), mods.sliding_window(64, 16),
        (randn((32, N), "float32", rng),), (0,), False),
}


@pytest.mark.parametrize("impl", ["pallas", "cute"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mods_on_gpu(case, impl):
    rng = fresh_rng()
    score_mod, mask_mod, aux, diff, sparse = CASES[case](rng)
    q = randn((B, T, N, H), "bfloat16", rng)
    k = randn((B, S, K, H), "bfloat16", rng)
    v = randn((B, S, K, H), "bfloat16", rng)
    w = randn((B, T, N, H), "float32", rng)
    plan = jaxflash.explain(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux=aux,
                            implementation=impl)
    if plan.backend is None:
        pytest.skip(str(plan))

    def grads(f, q, k, v, aux):
        def g(q, k, v, fa):
            full = tuple(fa[diff.index(i)] if i in diff else x for i, x in enumerate(aux))
            out = f(q, k, v, full)
            return jnp.sum(out.astype(jnp.float32) * w), out
        fa = tuple(aux[i] for i in diff)
        (_, out), gr = jax.value_and_grad(g, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, fa)
        return [out, *gr[:3], *gr[3]]

    def kernel(q, k, v, aux):
        bm = (mods.create_block_mask(mask_mod, B, 1, T, S, (64, 64), aux=aux) if sparse
              else None)
        return jaxflash.flash_attention(q, k, v, implementation=impl, score_mod=score_mod,
                                        mask_mod=mask_mod, aux=aux, block_mask=bm)

    up = lambda x: x.astype(jnp.float32)

    @jax.jit
    def run(q, k, v, aux):
        ref = grads(lambda q, k, v, a: jaxflash.flash_attention(
            q, k, v, implementation="xla", score_mod=score_mod, mask_mod=mask_mod, aux=a),
            up(q), up(k), up(v), aux)
        fth = grads(lambda q, k, v, a: faithful(q, k, v, score_mod=score_mod,
                                                mask_mod=mask_mod, aux=a), q, k, v, aux)
        return grads(kernel, q, k, v, aux), ref, fth

    got, ref, fth = run(q, k, v, aux)
    for name, x, r, f in zip(["out", "dq", "dk", "dv"] + [f"daux{i}" for i in diff],
                             got, ref, fth):
        check_rule(x, r, f, f"{case} {impl} {name}")
