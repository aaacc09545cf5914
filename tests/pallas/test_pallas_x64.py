"""The Pallas kernels with jax_enable_x64 on (Python ints are then int64 beside the int32 grid
indices): forward and gradients as without it. In a child process, since the flag is global."""
import os
import subprocess
import sys

_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np, jaxflash
assert jax.config.jax_enable_x64
rng = np.random.default_rng()
q = jnp.asarray(rng.standard_normal((2, 33, 4, 32)), jnp.float32)
k = jnp.asarray(rng.standard_normal((2, 47, 2, 32)), jnp.float32)
seg_q = jnp.asarray(np.sort(rng.integers(0, 3, (2, 33))), jnp.int32)
seg_k = jnp.asarray(np.sort(rng.integers(0, 3, (2, 47))), jnp.int32)
kw = dict(is_causal=True, q_segment_ids=seg_q, kv_segment_ids=seg_k)
def loss(impl):
    return lambda q, k: jnp.sum(jaxflash.flash_attention(q, k, k, implementation=impl, **kw) ** 2)
got = jax.jit(jax.value_and_grad(loss("pallas"), argnums=(0, 1)))(q, k)
want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1)))(q, k)
for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    err = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
    assert err < 1e-4, err
print("ok")
'''


def test_pallas_under_x64():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
