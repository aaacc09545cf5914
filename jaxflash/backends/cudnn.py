"""``implementation="cudnn"``: cuDNN's fused flash attention, through JAX's own cuDNN path (the
custom calls `jax.nn.dot_product_attention(implementation="cudnn")` lowers to), wrapped to
jaxflash's semantics. It serves the NVIDIA GPUs our kernels do not (Ampere, Ada, Blackwell) and
the Hopper calls `cute` refuses; `plan` refuses the rest, each with its reason (`explain`).

Served: CUDA; float16 / bfloat16; head dims (and value head dims) that are multiples of 8 up to
256 on Hopper and newer, up to 128 before Hopper and when no GPU is visible (JAX's own check then
assumes one older than Hopper); Hv != H on Hopper+ with cuDNN >= 9.10; MHA / GQA / MQA; causal
(top-left aligned: XLA builds cuDNN's graph with its top-left causal mask); sequence lengths
(cuDNN's padding mask, lengths clipped to [0, T] / [0, S]); a window (left, right) when causal
or right = 0, and T <= S (cuDNN's window is a left bound on top of the causal mask: sliding
window length left + 1; a window that removes nothing is dropped); a bias and/or a dense mask (one additive
bias in the inputs' dtype, masked entries at JAX's large negative value), with T and S even (as
cuDNN's backward with a bias needs).

Refused: softcap (no logit soft-capping in this cuDNN path), ALiBi (cuDNN's built-in ALiBi has
fixed slopes, no slope gradient; as a bias it would materialize the T x S logits the flash
kernels avoid), segment ids (cuDNN's packed mode takes contiguous segments by offsets, not
ids), a window with right > 0 without causal or with T > S (cuDNN: "Sliding window attention
is only supported with max_s_q <= max_s_kv"), and ``deterministic=True`` unless XLA runs with
``--xla_gpu_deterministic_ops=true`` (cuDNN's deterministic backward is that process-wide flag,
not a per-call switch).

Where cuDNN differs from jaxflash, the wrapper decides:

- LSE: cuDNN's softmax statistics ([B, N, T] float32, natural-log LSE of the scaled, biased
  logits), which its backward reads back.
- Rows with no visible key (padded query rows, kv length 0, a window past the keys, an
  all-False mask row, an all -inf bias row) get out = 0 and LSE = -inf (cuDNN averages the
  values there, leaves padded rows unwritten or returns NaN). Which rows those are is computed
  from the masks: O(B T) from lengths / causal / window, O(B N T S) only with a bias or mask,
  which are that size themselves.
- Backward: cuDNN's flash backward on the GIVEN (out, lse): it recomputes P = exp(s - lse) and
  D = rowsum(dout * out) from them, so it is exact for a plain call and for ring attention's
  merged (out, lse) alike, and nothing is recomputed. Rows with LSE -inf are handed a huge LSE
  (P = 0 there) and a zero dout; gradients of padded query rows and keys, and of a bias outside
  the lengths, are zeroed (cuDNN does not write them).

The cuDNN calls use JAX internals (`jax._src.cudnn.fused_attention_stablehlo`): the forward its
`dot_product_attention` (same signature in jax 0.10 to 0.12), the backward its backward primitive,
whose parameters differ between jax 0.10/0.11 and 0.12; an unknown version is refused, not
guessed.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxflash import masking
from jaxflash._types import GPU_PLATFORMS
from jaxflash.backends.base import Backend

# A finite stand-in for LSE = -inf in the backward: exp(s - _HUGE_LSE) = 0 for every logit.
_HUGE_LSE = 1e30

# Parameter names of `_dot_product_attention_bwd_rule`, whose bind parameters we mirror.
_BWD_RULE_0_10 = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                  "sliding_window_length", "is_training", "return_residual", "res",
                  "grad_output")  # jax 0.10, 0.11
_BWD_RULE_0_12 = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
                  "sliding_window_length", "score_mod", "cudnn_version", "return_residual",
                  "res", "grad_output")  # jax 0.12 (score_mod: cuDNN flex attention)


@dataclasses.dataclass(frozen=True)
class _Api:
    fa: object  # the module jax._src.cudnn.fused_attention_stablehlo
    bwd_takes_score_mod: bool


@functools.lru_cache(maxsize=None)
def _api():
    """(JAX's cuDNN attention module adapter, None) or (None, why it cannot be used)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable
        return None, f"JAX's cuDNN attention module cannot be imported ({e})"
    need = ("dot_product_attention", "MaskType", "AttentionLayout",
            "_dot_product_attention_bwd_p_wrapper", "_dot_product_attention_bwd_rule")
    missing = [n for n in need if not hasattr(fa, n)]
    if missing:
        return None, (f"jax {jax.__version__}'s cuDNN attention internals lack {missing} "
                      "(jaxflash knows those of jax 0.10 to 0.12)")
    params = tuple(inspect.signature(fa._dot_product_attention_bwd_rule).parameters)
    if params not in (_BWD_RULE_0_10, _BWD_RULE_0_12):
        return None, (f"jax {jax.__version__}'s cuDNN attention backward has parameters "
                      f"{params}, not those jaxflash knows (jax 0.10 to 0.12)")
    return _Api(fa, params == _BWD_RULE_0_12), None


@dataclasses.dataclass(frozen=True)
class _Env:
    """The local CUDA GPU's compute capability and cuDNN version; None where unknown. ``why``
    says why cuDNN cannot be used in this process at all (None when it can)."""

    cc: Optional[tuple[int, int]]
    cudnn: Optional[int]
    why: Optional[str] = None


@functools.lru_cache(maxsize=None)
def _env() -> _Env:
    try:
        from jax._src.lib import cuda_versions
    except Exception:  # noqa: BLE001
        cuda_versions = None
    cudnn = None
    if cuda_versions is not None:
        try:
            cudnn = int(cuda_versions.cudnn_get_version())
        except Exception:  # noqa: BLE001
            cudnn = None
    if cudnn is None:
        return _Env(None, None, "cuDNN is not available in this process (JAX's CUDA plugin "
                                "is not installed), so its attention cannot be lowered here")
    cc = None
    try:
        if jax.default_backend() == "gpu":
            from jax._src import xla_bridge
            if "cuda" in xla_bridge.get_backend().platform_version:
                major, minor = jax.devices()[0].compute_capability.split(".")[:2]
                cc = (int(major), int(minor))
    except Exception:  # noqa: BLE001 - no visible CUDA GPU: plan as JAX's own check would
        cc = None
    return _Env(cc, cudnn)


def _deterministic_flag() -> bool:
    flags = os.environ.get("XLA_FLAGS", "")
    return any(f"--{name}=true" in flags
               for name in ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops"))


@dataclasses.dataclass(frozen=True)
class CudnnPlan:
    """How a call maps onto cuDNN: its mask type (``NO_MASK``, ``CAUSAL``, ``PADDING``,
    ``PADDING_CAUSAL``), the sliding window length (left + 1) or None, and whether a bias and/or
    mask travel as cuDNN's additive bias."""

    mask_type: str
    window: Optional[int]
    dense: bool
    where: str

    @property
    def note(self) -> str:
        parts = [f"mask {self.mask_type}"]
        if self.window is not None:
            parts.append(f"sliding window {self.window}")
        if self.dense:
            parts.append("bias / mask as one additive bias")
        return (f"cuDNN fused attention {self.where} ({', '.join(parts)}); rows with no visible "
                "key set to 0 / LSE -inf by jaxflash")


class CudnnBackend(Backend):
    name = "cudnn"

    def plan(self, problem):
        p, s = problem, problem.statics
        if s.fp8 is not None:
            raise NotImplementedError(
                "cuDNN's FP8 attention (reachable only through a private jax function) takes "
                "per-tensor scales, returns FP8, and its backward passes the scales in the wrong "
                "order; it is not wired in")
        if p.platform not in GPU_PLATFORMS:
            raise NotImplementedError(f"cuDNN attention runs on NVIDIA GPUs only "
                                      f"(platform {p.platform})")
        if s.mods is not None:
            raise NotImplementedError("score_mod / mask_mod: cuDNN's fused attention takes a "
                                      "dense bias or mask, not mod functions")
        api, why = _api()
        if api is None:
            raise NotImplementedError(why)
        env = _env()
        if env.why:
            raise NotImplementedError(env.why)
        if p.dtype not in ("float16", "bfloat16"):
            raise NotImplementedError(f"cuDNN fused attention takes float16 / bfloat16, "
                                      f"not {p.dtype}")
        hopper = env.cc is not None and env.cc >= (9, 0)
        hmax = 256 if hopper else 128
        where = (f"on sm_{env.cc[0]}{env.cc[1]}, cuDNN {env.cudnn}" if env.cc is not None
                 else "with no GPU visible (JAX's check then assumes one older than Hopper)")
        for what, h in (("head dim", p.head_dim), ("value head dim", p.head_dim_v)):
            if h % 8 or h > hmax:
                raise NotImplementedError(f"{what} {h}: cuDNN takes multiples of 8 up to {hmax} "
                                          f"{where}")
        if p.head_dim_v != p.head_dim and not (hopper and env.cudnn >= 91000):
            raise NotImplementedError(
                f"value head dim {p.head_dim_v} != head dim {p.head_dim}: cuDNN needs a Hopper "
                f"or newer GPU and cuDNN >= 9.10 for that ({where})")
        if env.cc == (10, 3) and env.cudnn < 91100:
            raise NotImplementedError(f"sm_103 needs cuDNN >= 9.11 ({where})")
        if s.softcap is not None:
            raise NotImplementedError("softcap: this cuDNN path has no logit soft-capping")
        if p.has_alibi:
            raise NotImplementedError(
                "ALiBi: cuDNN's built-in ALiBi has fixed slopes and no slope gradient, and as a "
                "bias it would materialize the T x S logits")
        if p.has_segments:
            raise NotImplementedError(
                "segment ids: cuDNN's packed mode takes contiguous segments by offsets, not ids")
        if s.deterministic and not _deterministic_flag():
            raise NotImplementedError(
                "deterministic=True: cuDNN's deterministic backward is the process-wide XLA flag "
                "--xla_gpu_deterministic_ops=true, which is not set")
        causal, window = s.is_causal, None
        if s.window is not None:
            left, right = s.window
            if not causal and right > 0:
                raise NotImplementedError(
                    f"window {s.window} without is_causal: cuDNN's window only bounds keys on "
                    "the left of a causal mask (right = 0, or is_causal)")
            causal = True  # keys right of the diagonal are out either way
            if left < p.q_len - 1:  # else j >= i - left removes nothing
                if p.q_len > p.kv_len:
                    raise NotImplementedError(
                        f"window {s.window} with T = {p.q_len} > S = {p.kv_len}: cuDNN's "
                        "sliding window needs T <= S")
                window = left + 1
        dense = p.bias_shape is not None or p.has_mask
        if dense and (p.q_len % 2 or p.kv_len % 2):
            raise NotImplementedError(
                f"a bias or dense mask with T = {p.q_len}, S = {p.kv_len}: cuDNN's backward "
                "with a bias needs both even")
        padding = p.has_q_seqlen or p.has_kv_seqlen
        mask_type = ("PADDING_CAUSAL" if padding and causal else "PADDING" if padding
                     else "CAUSAL" if causal else "NO_MASK")
        return CudnnPlan(mask_type, window, dense, where)

    def notes(self, detail):
        return (detail.note,)

    def forward(self, q, k, v, arrays, statics, plan):
        d, api = plan.detail, _api()[0]
        B, T, N, _ = q.shape
        S = k.shape[1]
        qlen, kvlen = _lengths(arrays, d, B, T, S)
        out, stats = api.fa.dot_product_attention(
            q, k, v, bias=_dense_bias(arrays, q.dtype), mask=None, q_seqlen=qlen,
            kv_seqlen=kvlen, scale=statics.scale, mask_type=api.fa.MaskType[d.mask_type],
            qkv_layout="BTNH", sliding_window_length=d.window, return_residual=True)
        lse = stats.astype(jnp.float32)
        empty = empty_rows(arrays, statics, T, S)
        if empty is not None:
            lse = jnp.where(empty, -jnp.inf, lse)
            out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], jnp.zeros((), out.dtype), out)
        return out, lse

    def backward(self, q, k, v, arrays, statics, plan, out, lse, dout):
        d, api = plan.detail, _api()[0]
        B, T, N, _ = q.shape
        S = k.shape[1]
        fa = api.fa
        qlen, kvlen = _lengths(arrays, d, B, T, S)
        lengths = arrays.q_seqlen is not None or arrays.kv_seqlen is not None
        bias = _dense_bias(arrays, q.dtype)
        if bias is not None and arrays.bias is not None and lengths and bias.shape[0] != B:
            # cuDNN sums dbias over a broadcast batch itself, including the rows / keys past
            # the lengths that it does not write: give it the batch, zero those, sum here.
            bias = jnp.broadcast_to(bias, (B,) + bias.shape[1:])
        empty = ~jnp.isfinite(lse)  # [B, N, T]: rows with nothing to attend to
        stats = jnp.where(empty, _HUGE_LSE, lse).astype(jnp.float32)
        dout = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], 0, dout).astype(q.dtype)
        unused = jnp.zeros((0,), q.dtype)
        has_dbias = arrays.bias is not None
        kw = dict(scale=statics.scale, seed=42, dropout_rate=0.0,
                  variadic_args=(bias is not None, has_dbias),
                  mask_type=fa.MaskType[d.mask_type], layout=fa.AttentionLayout.BTNH.value,
                  sliding_window_length=d.window)
        if api.bwd_takes_score_mod:
            kw["score_mod"] = None
        grads = fa._dot_product_attention_bwd_p_wrapper.bind(
            q, k, v, unused if bias is None else bias, unused if qlen is None else qlen,
            unused if kvlen is None else kvlen, unused, unused, unused, unused, stats,
            out.astype(q.dtype), dout, **kw)
        dq, dk, dv = grads[0], grads[1], grads[2]
        dq = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], jnp.zeros((), dq.dtype), dq)
        if arrays.kv_seqlen is not None:
            gone = (jnp.arange(S)[None, :] >= kvlen[:, None])[:, :, None, None]  # [B, S, 1, 1]
            dk = jnp.where(gone, jnp.zeros((), dk.dtype), dk)
            dv = jnp.where(gone, jnp.zeros((), dv.dtype), dv)
        dbias = None
        if has_dbias:
            dbias = grads[3]
            if lengths:
                t, s_ = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
                ok = (t < qlen[:, None, None]) & (s_ < kvlen[:, None, None])  # [B, T, S]
                dbias = jnp.where(ok[:, None], dbias, jnp.zeros((), dbias.dtype))
            axes = tuple(a for a in (0, 1) if arrays.bias.shape[a] == 1 and dbias.shape[a] != 1)
            if axes:
                dbias = jnp.sum(dbias.astype(jnp.float32), axis=axes, keepdims=True)
        return dq, dk, dv, dbias, None


def _lengths(arrays, d, B, T, S):
    """int32 [B] q / kv lengths for cuDNN's padding mask (both, clipped to the sequence), or
    (None, None) when the plan has no padding mask."""
    if not d.mask_type.startswith("PADDING"):
        return None, None
    full = lambda n: jnp.full((B,), n, jnp.int32)
    qlen = full(T) if arrays.q_seqlen is None else jnp.clip(arrays.q_seqlen, 0, T)
    kvlen = full(S) if arrays.kv_seqlen is None else jnp.clip(arrays.kv_seqlen, 0, S)
    return qlen.astype(jnp.int32), kvlen.astype(jnp.int32)


def _large_negative(dtype):
    """JAX's value for masked entries of cuDNN's bias (it works around a cuDNN defect with
    -inf): -2^41 in bfloat16, -2^15 in float16."""
    return -(2.0 ** 41) if jnp.dtype(dtype) == jnp.bfloat16 else -(2.0 ** 15)


def _dense_bias(arrays, dtype):
    """The bias and dense mask as one additive bias in `dtype` ([Bx, Nx, T, S]), or None.

    Bias values are clipped to [masked value, dtype max] (below the masked value they weigh
    nothing either way: exp underflows), so no -inf or overflow reaches cuDNN; rows that are
    -inf throughout are found by `empty_rows`. Masked entries are set, not added, so they
    cannot overflow either."""
    if arrays.bias is None and arrays.mask is None:
        return None
    neg = _large_negative(dtype)
    bias = None
    if arrays.bias is not None:
        bias = jnp.clip(arrays.bias.astype(jnp.float32), neg,
                        float(jnp.finfo(dtype).max)).astype(dtype)
    if arrays.mask is None:
        return bias
    if bias is None:
        return jnp.where(arrays.mask, jnp.zeros((), dtype), jnp.asarray(neg, dtype))
    return jnp.where(arrays.mask, bias, jnp.asarray(neg, dtype))


def empty_rows(arrays, statics, T: int, S: int):
    """Bool ``[Bx, Nx, T]`` (broadcasting to [B, N, T]): True where query row t has no key left
    to attend to under jaxflash's semantics; None when no row can be empty.

    Without a bias or mask: O(B T) from the lengths, causal and window (the visible keys of a
    row are an interval). With one: the T x S predicate, reduced over keys (a bias row that is
    -inf on every visible key counts as empty)."""
    dense = arrays.bias is not None or arrays.mask is not None
    if not (dense or statics.window is not None or arrays.q_seqlen is not None
            or arrays.kv_seqlen is not None):
        return None  # every row sees key 0 (top-left causal included)
    t = jnp.arange(T, dtype=jnp.int32)
    if dense:
        bcast = lambda x: None if x is None else x[:, None, None, None]
        keep = masking.keep(t[:, None], jnp.arange(S, dtype=jnp.int32)[None, :],
                            is_causal=statics.is_causal, window=statics.window,
                            q_seqlen=bcast(arrays.q_seqlen), kv_seqlen=bcast(arrays.kv_seqlen))
        vis = jnp.ones((1, 1, T, S), bool) if keep is None else jnp.broadcast_to(
            keep, jnp.broadcast_shapes(keep.shape, (1, 1, T, S)))
        if arrays.mask is not None:
            vis = vis & arrays.mask
        if arrays.bias is not None:
            vis = vis & (arrays.bias > -jnp.inf)
        return ~jnp.any(vis, axis=-1)
    lo = jnp.zeros((T,), jnp.int32)
    hi = jnp.full((T,), S - 1, jnp.int32)
    if statics.is_causal:
        hi = jnp.minimum(hi, t)
    if statics.window is not None:
        left, right = (min(w, T + S) for w in statics.window)  # (no int32 overflow)
        lo = jnp.maximum(lo, t - left)
        hi = jnp.minimum(hi, t + right)
    lo, hi = lo[None], hi[None]  # [1, T]
    if arrays.kv_seqlen is not None:
        hi = jnp.minimum(hi, arrays.kv_seqlen[:, None] - 1)
    ok = lo <= hi
    if arrays.q_seqlen is not None:
        ok = ok & (t[None] < arrays.q_seqlen[:, None])
    return ~ok[:, None, :]  # [Bx, 1, T]
