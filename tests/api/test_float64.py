"""float64 inputs under jax_enable_x64, as jax.nn.dot_product_attention takes them: the XLA
reference computes in float64 (LSE and gradients included, ring attention too), the kernels
refuse by name, and precision="fp8" / "fp4" refuse float64 as a caller mistake. In a child
process, since the flag is global."""
import os
import subprocess
import sys

_SCRIPT = r'''
import jax, jax.numpy as jnp, numpy as np, pytest, jaxflash
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert jax.config.jax_enable_x64
rng = np.random.default_rng()
B, T, S, N, K, H = 2, 13, 17, 4, 2, 16
q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
slopes = jnp.asarray(rng.random(N))
seg_q = jnp.asarray(np.sort(rng.integers(0, 2, (B, T))), jnp.int32)
seg_k = jnp.asarray(np.sort(rng.integers(0, 2, (B, S))), jnp.int32)
temp = jnp.asarray(1.0 + 0.1 * rng.standard_normal(N))
mod = lambda s, b, h, qi, ki, t: s * t[h]

def ours(q, k, v, a, t):
    o, lse = jaxflash.flash_attention(q, k, v, is_causal=True, alibi_slopes=a, q_segment_ids=seg_q,
                                      kv_segment_ids=seg_k, score_mod=mod, aux=(t,),
                                      return_residual=True)
    return jnp.sum(jnp.sin(o)), (o, lse)

def plain(q, k, v, a, t):   # float64 attention written out (GQA by repetition)
    kk, vv = jnp.repeat(k, N // K, 2), jnp.repeat(v, N // K, 2)
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    s = jnp.einsum("btnd,bsnd->bnts", q, kk) / np.sqrt(H)
    s = (s - a[None, :, None, None] * jnp.abs(i - j)) * t[None, :, None, None]
    keep = (j <= i) & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    e = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
    l = jnp.sum(e, -1, keepdims=True)
    o = jnp.einsum("bnts,bsnd->btnd", e / jnp.where(l > 0, l, 1), vv)
    lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0], -jnp.inf)
    return jnp.sum(jnp.sin(o)), (o, jnp.swapaxes(lse, 1, 2))

args = (q, k, v, slopes, temp)
vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))
(_, (o, lse)), g = vg(ours)(*args)
(_, (o2, lse2)), g2 = vg(plain)(*args)
assert o.dtype == lse.dtype == jnp.float64 and all(x.dtype == jnp.float64 for x in g)
fin = np.isfinite(np.asarray(lse2))
assert (np.isfinite(np.asarray(lse)) == fin).all()
for x, y in [(o, o2), (lse[fin], lse2[fin])] + list(zip(g, g2)):
    err = float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
    assert err < 1e-12, err
assert "'xla' runs" in str(jaxflash.explain(q, k, v))
with pytest.raises(NotImplementedError, match="float64"):
    jaxflash.flash_attention(q, k, v, implementation="pallas")
with pytest.raises(ValueError, match="float64"):
    jaxflash.flash_attention(q, k, v, precision="fp8")

# ring attention (2 devices) and a batch-sharded call keep float64
mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
q2, k2 = (jnp.asarray(rng.standard_normal((2, 16, 2, 16))) for _ in range(2))
ring = lambda q: jnp.sum(jnp.sin(jaxflash.ring_attention(q, k2, k2, mesh=mesh, seq_axis="sp",
                                                         is_causal=True, implementation="xla")))
one = lambda q: jnp.sum(jnp.sin(jaxflash.flash_attention(q, k2, k2, is_causal=True)))
gr, g1 = jax.jit(jax.grad(ring))(q2), jax.jit(jax.grad(one))(q2)
assert gr.dtype == jnp.float64 and float(jnp.abs(gr - g1).max()) < 1e-12
sh = NamedSharding(mesh, P("sp"))
gs = jax.jit(jax.grad(one))(jax.device_put(q2, sh))
assert float(jnp.abs(gs - g1).max()) < 1e-12
# the Flax attention_fn takes its fast path (flash_attention) in float64 too
from jaxflash.flax_layers import attention_fn
qa = jnp.asarray(rng.standard_normal((2, 7, 2, 8)))
fa = attention_fn(qa, qa, qa)
kk = jnp.einsum("btnd,bsnd->bnts", qa, qa) / np.sqrt(8)
pa = jnp.exp(kk - kk.max(-1, keepdims=True)); pa = pa / pa.sum(-1, keepdims=True)
assert fa.dtype == jnp.float64
assert float(jnp.abs(fa - jnp.einsum("bnts,bsnd->btnd", pa, qa)).max()) < 1e-13
print("ok")
'''


def test_float64_under_x64():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
