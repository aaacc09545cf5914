"""Emulated Direct-P FP4 attention forward (non-causal inference), in plain JAX.

What is emulated (paper section 4; constants from ``jaxflash.fp4.constants``):

* Q, K in NVFP4 (blocks of 16 along the head dim, E4M3 block scales, one float32 global factor
  G = 448*6/amax per (batch, head), or per tensor with ``qk_global="tensor"``); S = Q_hat K_hat^T in float32 (the tensor core multiplies the
  FP4 payloads and scales exactly and accumulates in FP32).
* V in MXFP4 along the key axis (blocks of 32 keys = the PV MMA's K dimension, E8M0 scales,
  rule ``constants.V_SCALE_RULE``).
* P produced straight from the scores, per row i and N32 key block B:
  y = (z - m_i) log2 e; e_B from the block max (rule ``constants.P_SCALE_RULE``);
  x = y - e_B + log2 6; q = E2M1(max(0, A x + B)) (affine pairs) or q = E2M1(2^x) (native-EX2
  pairs of the accurate policy); u_B = e_B + 127 (u_B <= 0, or an all-masked block: zero block);
  represented p~ = 2^(u_B - 127) q / 6.
* The denominator is built from the same represented P that the PV product consumes: the
  emulator runs the PV product on [V_hat, 1] (a ones column).  Per N32 block the partial sums
  sum_j q_ij v_hat_j and c_B = sum_j q_ij are exact in float32 (E2M1 x E2M1 products under one
  E8M0 scale, 32 terms), and the blocks are combined with their 2^(e'_B - R) weights in one fixed
  order for every column, so L~ = sum_B alpha_B c_B / 6 uses exactly the codes and the arithmetic
  of the numerator; V = ones therefore gives 1.0 per row exactly, on any backend.  The kernel evaluates each block term as alpha'_B * (c_B / 6), never
  (alpha'_B / 6) * c_B; ``denominator_term`` is that formula, for the FTZ test.
* The extreme-logit guard (``guard=(M, L)`` or ``True``): 128 globally spread key rows give the
  anchor a_i = max_j z_ij over them; m_i = a_i + M ln 2; working byte u_bar = max(u_B, L + 1)
  (capped at 254); published byte u' = u_bar - L; requires M + L <= 126.
* Flash-style blocking: ``lax.scan`` over key tiles of 128 (four N32 blocks), so a 32k sequence
  never materialises a T x S tensor.  The numerator/denominator accumulators are kept relative to a
  running per-row power of two 2^R (R = the largest published block exponent so far); rescaling
  by powers of two is exact, so this equals the kernel's unscaled FP32 accumulation while
  staying clear of XLA:CPU's flush-to-zero.  The kernel's FP32 range is still modelled: a row
  whose literal accumulators (2^R acc) would exceed FP32 returns NaN, as the kernel's inf/inf
  would, and so does a row whose every block term underflows (0 / 0).  Without a shift (the
  "fast" policy, m_i = 0) that bounds a row's logits to about [-87, +80] (e^88 is 2^127): use
  the guard or "accurate" (a per-row shift) beyond.

Policies (``constants.POLICIES``): "fast" = all-affine, shiftless (m_i = 0: the E8M0 block exponent
carries the range); "accurate" = m_i from 32 fixed anchor key rows and native EX2 on 25 % of the
pair positions; "wan" = the A=1.60, B=0.95 fit.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash.fp4 import constants as C
from jaxflash.fp4 import formats as F

__all__ = ["direct_p_attention", "direct_p_probabilities", "denominator_term", "e2m1_round",
           "resolve_policy"]


def e2m1_round(u) -> jax.Array:
    """Value of E2M1(max(0, u)) (RN-even, saturating) for float32 u: the F2FP.SATFINITE.RELU.E2M1
    convert followed by decode, as a boundary count (same result as formats.e2m1_encode(u,
    relu=True) then e2m1_decode; tested)."""
    u = jnp.asarray(u, jnp.float32)
    vals = F.E2M1_VALUES
    out = jnp.zeros_like(u)
    for j, t in enumerate(F.E2M1_BOUNDARIES):
        step = vals[j + 1] - vals[j]
        up = (u > t) | ((u == t) & (j % 2 == 1))       # tie -> the even code (j+1 even <=> j odd)
        out = out + jnp.where(up, jnp.float32(step), jnp.float32(0))
    return jnp.where(jnp.isnan(u), jnp.float32(F.E2M1_MAX if F.E2M1_NAN_CODE == 7 else 0), out)


def denominator_term(u_published, c_sum, *, order: str = "kernel") -> jax.Array:
    """One block's denominator term in float32, as the kernel evaluates it: alpha' * (c / 6)
    ("kernel"), or the rejected (alpha' / 6) * c ("rejected"), whose alpha'/6 is subnormal at
    u' = 1 and is flushed to zero under FTZ (the paper's layer-39 failure)."""
    alpha = F.e8m0_decode(jnp.asarray(u_published).astype(jnp.uint8))
    c = jnp.asarray(c_sum, jnp.float32)
    sixth = jnp.float32(1.0 / 6.0)
    if order == "kernel":
        return alpha * (c * sixth)
    if order == "rejected":
        return (alpha * sixth) * c
    raise ValueError(order)


def resolve_policy(policy: Union[str, dict], A=None, B=None) -> dict:
    if isinstance(policy, str):
        if policy not in C.POLICIES:
            raise ValueError(f"policy must be one of {sorted(C.POLICIES)}, got {policy!r}")
        pol = dict(C.POLICIES[policy], name=policy)
    else:
        pol = dict(policy)
        pol.setdefault("name", "custom")
    if A is not None:
        pol["A"] = float(A)
    if B is not None:
        pol["B"] = float(B)
    return pol


def _resolve_guard(guard) -> Optional[Tuple[int, int]]:
    if guard is None or guard is False:
        return None
    if guard is True:
        guard = C.GUARD_DEFAULT_M_L
    M, L = guard
    C.check_guard(M, L)
    return int(M), int(L)


def _pow2_int(e):
    """float32 2^e for int32 e <= 127; 0 below 2^-126 (flush, as FTZ would)."""
    e = jnp.asarray(e, jnp.int32)
    ec = jnp.clip(e, -126, 127)
    v = lax.bitcast_convert_type(((ec + 127) << 23).astype(jnp.uint32), jnp.float32)
    return jnp.where(e < -126, jnp.float32(0), v)


def _block_exponent(y_max, rule: str):
    if rule == "ocp":
        return jnp.floor(y_max + jnp.float32(C.P_SCALE_OCP_OFFSET))
    if rule == "ceil":
        return jnp.ceil(y_max)
    if rule == "floor":
        return jnp.floor(y_max)
    raise ValueError(f"p_scale_rule must be 'ocp', 'ceil' or 'floor', got {rule!r}")


def direct_p_probabilities(y, *, A: float, B: float, native_mask=None, p_scale_rule: str = None,
                           guard_shift: Optional[int] = None):
    """Direct-P codes for scores already in log2 units relative to the row reference.

    y: float32 [..., nb, 32] = (z - m) log2 e, -inf for masked keys.  native_mask: bool [32]
    (True = native EX2 for that position) or None.  guard_shift: the guard's L, or None.
    Returns (q, e_pub, zero): q float32 E2M1 values [..., nb, 32]; e_pub int32 [..., nb] the
    published block exponent (u' - 127); zero bool [..., nb] (zero block: u = 0, q = 0).
    """
    rule = p_scale_rule or C.P_SCALE_RULE
    y_max = jnp.max(y, axis=-1)
    masked = y_max == -jnp.inf
    e = _block_exponent(jnp.where(masked, 0.0, y_max), rule)
    u = jnp.clip(e, -1000.0, 1000.0).astype(jnp.int32) + C.E8M0_BIAS
    if guard_shift is None:
        zero = masked | (u < C.E8M0_MIN_BYTE)
        u_work = jnp.clip(u, C.E8M0_MIN_BYTE, C.E8M0_MAX_BYTE)
        u_pub = u_work
    else:
        zero = masked
        u_work = jnp.clip(jnp.maximum(u, guard_shift + 1), None, C.E8M0_MAX_BYTE)
        u_pub = u_work - guard_shift
    e_work = (u_work - C.E8M0_BIAS).astype(jnp.float32)
    x = (y - e_work[..., None]) + jnp.float32(C.LOG2_6)
    q = e2m1_round(jnp.float32(A) * x + jnp.float32(B))
    if native_mask is not None:
        q_nat = e2m1_round(jnp.exp2(x))
        q = jnp.where(native_mask, q_nat, q)
    q = jnp.where(zero[..., None], jnp.float32(0), q)
    return q, u_pub - C.E8M0_BIAS, zero


def _native_mask(pol) -> Optional[np.ndarray]:
    period = pol.get("native_ex2_pair_period", 0)
    if not period:
        return None
    pair = np.arange(C.P_BLOCK) // 2
    return (pair % period) == pol.get("native_ex2_pair_offset", 0)


def _spread_indices(S: int, n: int) -> np.ndarray:
    n = min(n, S)
    return (np.arange(n) * S) // n


@functools.partial(jax.jit, static_argnames=("scale", "policy", "A", "B", "guard", "p_scale_rule",
                                             "v_scale_rule", "return_lse", "key_tile", "qk_global"))
def _direct_p_impl(q, k, v, *, scale, policy, A, B, guard, p_scale_rule, v_scale_rule,
                   return_lse, key_tile, qk_global):
    pol = dict(policy)
    Bt, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K
    # --- operands as the kernel sees them -------------------------------------------------
    qt = jnp.transpose(q, (0, 2, 1, 3)).astype(jnp.float32)          # [B, N, T, H]
    kt = jnp.transpose(k, (0, 2, 1, 3)).astype(jnp.float32)          # [B, K, S, H]
    gax = (2, 3) if qk_global == "head" else (0, 1, 2, 3)
    q_hat = F.nvfp4_dequantize(F.nvfp4_quantize(qt, global_axes=gax))
    k_hat = F.nvfp4_dequantize(F.nvfp4_quantize(kt, global_axes=gax))
    n_tiles = -(-S // key_tile)
    Sp = n_tiles * key_tile
    vt = jnp.transpose(v, (0, 2, 3, 1)).astype(jnp.float32)          # [B, K, Hv, S] K-major V
    vt = jnp.pad(vt, ((0, 0), (0, 0), (0, 0), (0, Sp - S)))
    v_hat = F.mxfp4_dequantize(F.mxfp4_quantize(vt, rule=v_scale_rule))
    v_hat = jnp.swapaxes(v_hat, -1, -2)                               # [B, K, Sp, Hv]
    v_ext = jnp.concatenate([v_hat, jnp.ones(v_hat.shape[:-1] + (1,), jnp.float32)], -1)
    k_hat = jnp.pad(k_hat, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
    q_hat = q_hat.reshape(Bt, K, G, T, H)
    hp = lax.Precision.HIGHEST

    def scores(k_rows):                                               # [B, K, G, T, s]
        return jnp.einsum("bkgth,bksh->bkgts", q_hat, k_rows, precision=hp) * jnp.float32(scale)

    # --- row reference m_i -------------------------------------------------------------------
    shift = None
    if guard is not None:
        M, L = guard
        idx = _spread_indices(S, C.GUARD_SAMPLE_ROWS)
        m = jnp.max(scores(k_hat[:, :, idx]), axis=-1) + jnp.float32(M * C.LN2)
        shift = L
    elif pol.get("anchor_rows", 0):
        idx = _spread_indices(S, pol["anchor_rows"])
        m = jnp.max(scores(k_hat[:, :, idx]), axis=-1)
    else:
        m = jnp.zeros((Bt, K, G, T), jnp.float32)
    native = _native_mask(pol)
    nb = key_tile // C.P_BLOCK

    k_tiles = jnp.moveaxis(k_hat.reshape(Bt, K, n_tiles, key_tile, H), 2, 0)
    v_tiles = jnp.moveaxis(v_ext.reshape(Bt, K, n_tiles, key_tile, Hv + 1), 2, 0)
    starts = jnp.arange(n_tiles) * key_tile
    R0 = jnp.full((Bt, K, G, T), -(1 << 20), jnp.int32)
    acc0 = jnp.zeros((Bt, K, G, T, Hv + 1), jnp.float32)

    def step(carry, xs):
        acc, R = carry
        k_t, v_t, start = xs
        z = scores(k_t)
        valid = (start + jnp.arange(key_tile)) < S
        y = jnp.where(valid, (z - m[..., None]) * jnp.float32(C.LOG2E), -jnp.inf)
        y = y.reshape(y.shape[:-1] + (nb, C.P_BLOCK))
        qv, e_pub, zero = direct_p_probabilities(
            y, A=pol["A"], B=pol["B"], native_mask=native, p_scale_rule=p_scale_rule,
            guard_shift=shift)
        e_live = jnp.where(zero, -(1 << 20), e_pub)
        R_new = jnp.maximum(R, jnp.max(e_live, axis=-1))
        wgt = _pow2_int(e_live - R_new[..., None])                     # exact 2^(e' - R) per block
        # per-N32-block partial products: q (E2M1) x v_hat (E2M1 x one E8M0 scale per 32 keys)
        # sums of 32 such products are exact in fp32 in any order, on any backend; the ones
        # column gives c_B (the denominator uses the very codes the numerator consumes)
        v_b = v_t.reshape(v_t.shape[:2] + (nb, C.P_BLOCK, Hv + 1))
        part = jnp.einsum("bkgtnj,bknjd->bkgtnd", qv, v_b, precision=hp)
        acc = acc * _pow2_int(R - R_new)[..., None]
        for i in range(nb):                                 # fixed order, same for every column
            acc = acc + wgt[..., i, None] * part[..., i, :]
        return (acc, R_new), None

    (acc, R), _ = lax.scan(step, (acc0, R0), (k_tiles, v_tiles, starts))
    acc_n, acc_l = acc[..., :Hv], acc[..., Hv]
    # a true division (XLA:CPU would turn a division by a broadcast into a reciprocal multiply;
    # the barrier stops that); XLA:GPU divides with div.full.f32 (<= 2 ulp, x / x may miss 1),
    # so equal numerator and denominator are mapped to exactly 1 explicitly
    denom = lax.optimization_barrier(jnp.broadcast_to(acc_l[..., None], acc_n.shape))
    # (a row whose every block term underflowed has 0 / 0: NaN, as in the kernel)
    out = jnp.where((acc_n == denom) & (denom != 0), jnp.float32(1), acc_n / denom)
    # kernel FP32 range model: literal accumulators are 2^R * acc (numerator before the 1/36,
    # i.e. up to 6 * acc_n with V in the alpha*q/6 convention; denominator 2^R * acc_l / 6)
    big = jnp.maximum(acc_l * jnp.float32(1 / 6), 6.0 * jnp.max(jnp.abs(acc_n), axis=-1))
    lit_exp = R.astype(jnp.float32) + jnp.log2(jnp.maximum(big, 1e-30))
    overflow = lit_exp >= 128.0
    out = jnp.where(overflow[..., None], jnp.nan, out)
    out = out.reshape(Bt, N, T, Hv).transpose(0, 2, 1, 3).astype(q.dtype)
    if not return_lse:
        return out
    Lsh = 0 if shift is None else shift
    lse = (m + jnp.float32(C.LN2) * (R + Lsh).astype(jnp.float32) + jnp.log(acc_l)
           - jnp.float32(np.log(6.0)))
    lse = jnp.where(overflow, jnp.nan, lse)
    return out, lse.reshape(Bt, N, T)


@jax.custom_jvp
def no_derivative(x):
    """x unchanged; differentiating through it raises. Direct-P's roundings have derivative
    zero almost everywhere: autodiff would return zero gradients silently."""
    return x


@no_derivative.defjvp
def no_derivative_jvp(primals, tangents):
    raise NotImplementedError(
        "the Direct-P FP4 path (non-causal precision='fp4', direct_p_attention) is inference "
        "only: its roundings have no useful derivative; the causal FP4 path "
        "(fp4_training_attention) trains")


def direct_p_attention(q, k, v, *, scale: Optional[float] = None,
                       policy: Union[str, dict] = "fast", A: Optional[float] = None,
                       B: Optional[float] = None, guard=None, p_scale_rule: Optional[str] = None,
                       v_scale_rule: Optional[str] = None, return_lse: bool = False,
                       key_tile: int = C.KEY_TILE, qk_global: str = "head"):
    """Emulated Direct-P FP4 non-causal attention forward.

    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv]; N a multiple of K (GQA/MQA).  H must be a
    multiple of 16 (NVFP4 blocks).  ``policy``: "fast" | "accurate" | "wan" or a dict like
    ``constants.POLICIES[...]``; ``A``/``B`` override the affine map.  ``guard``: None, True
    (M, L = constants.GUARD_DEFAULT_M_L) or (M, L) with M + L <= 126.  Returns the output in q's
    dtype [B, T, N, Hv], and with ``return_lse`` also the float32 log-sum-exp [B, N, T] of the
    represented probabilities (natural log, in units of z = scale * q.k).  ``qk_global``: the
    NVFP4 global factor G = 448*6/amax of Q and of K is taken per (batch, head) ("head", default,
    as the training recipe's per-head Q-K factors) or over the whole tensor ("tensor").
    """
    if qk_global not in ("head", "tensor"):
        raise ValueError(f"qk_global must be 'head' or 'tensor', got {qk_global!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if q.shape[3] % C.QK_BLOCK:
        raise ValueError(f"head dim must be a multiple of {C.QK_BLOCK} for NVFP4 Q/K")
    if key_tile % C.P_BLOCK:
        raise ValueError(f"key_tile must be a multiple of {C.P_BLOCK}")
    pol = resolve_policy(policy, A, B)
    scale = float(1.0 / np.sqrt(q.shape[3])) if scale is None else float(scale)
    q, k, v = (no_derivative(x) for x in (q, k, v))
    return _direct_p_impl(
        q, k, v, scale=scale, policy=tuple(sorted(pol.items())), A=pol["A"], B=pol["B"],
        guard=_resolve_guard(guard), p_scale_rule=p_scale_rule or C.P_SCALE_RULE,
        v_scale_rule=v_scale_rule or C.V_SCALE_RULE, return_lse=return_lse, key_tile=key_tile,
        qk_global=qk_global)
