"""Correctness checks run before anything is timed, so a wrong kernel cannot post a speed.

Two measures per output:
- `rel_l2(x, base)`: ||x - base|| / ||base|| over the whole tensor, against the baseline
  implementation's output on the same inputs (cuDNN on a GPU).
- `sampled_reference_error`: against the exact float32 softmax attention computed on a few query
  rows of the first batch element (all heads, all keys). Cheap at every S, and it checks the
  baseline itself, which the first measure cannot.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Relative-L2 limits for bf16 (tests/common.py states the same): a flash kernel rounds P to bf16
# before the PV matmul, so two correct kernels differ by a few 1e-3; a wrong one by O(1).
FWD_TOL = 2e-2
GRAD_TOL = 5e-2


@jax.jit
def _rel_l2(x, base):
    x = x.astype(jnp.float32)
    base = base.astype(jnp.float32)
    return jnp.linalg.norm((x - base).ravel()) / jnp.linalg.norm(base.ravel())


def rel_l2(x, base) -> float:
    """NaN when x has a non-finite value (so the check fails); comparisons with NaN are False."""
    if x.shape != base.shape:
        raise ValueError(f"output shape {x.shape} differs from the baseline's {base.shape}")
    if not bool(jnp.all(jnp.isfinite(x))):
        return float("nan")
    return float(_rel_l2(x, base))


def sample_rows(S, n, seed):
    """n distinct query rows, always including the first and last (causal edge cases)."""
    n = min(n, S)
    rng = np.random.default_rng(seed)
    inner = rng.choice(np.arange(1, S - 1), size=max(0, n - 2), replace=False) if S > 2 else []
    return np.unique(np.concatenate([[0, S - 1], inner]).astype(np.int32))[:n]


def sampled_reference(q, k, v, causal, rows):
    """Exact float32 attention for query rows `rows` of batch element 0: [R, N, D]."""
    rows = jnp.asarray(rows)
    qs = q[0, rows].astype(jnp.float32)  # [R, N, D]
    ks = k[0].astype(jnp.float32)  # [S, N, D]
    vs = v[0].astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST  # no TF32 on GPUs
    logits = jnp.einsum("rnd,snd->nrs", qs, ks, precision=hp) / math.sqrt(q.shape[-1])
    if causal:
        visible = jnp.arange(k.shape[1])[None, :] <= rows[:, None]
        logits = jnp.where(visible[None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("nrs,snd->rnd", p, vs, precision=hp)


_sampled_reference = jax.jit(sampled_reference, static_argnums=(3,))


def sampled_reference_error(out, q, k, v, causal, rows) -> float:
    ref = _sampled_reference(q, k, v, causal, rows)
    got = out[0, jnp.asarray(rows)]
    return rel_l2(got, ref)


def passes(err: float, tol: float) -> bool:
    return err is not None and math.isfinite(err) and err <= tol
