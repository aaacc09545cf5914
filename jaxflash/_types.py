"""The canonical form every backend receives.

`jaxflash.api` validates the user's call and brings it into this one form, so backends never see
leading batch dims other than one, 3D inputs, int windows or broadcast-shaped seq lengths:

- q ``[B, T, N, H]``, k ``[B, S, K, H]``, v ``[B, S, K, Hv]``; N = K * G and query head ``n`` reads
  key/value head ``n // G`` (the grouping of ``jax.nn.dot_product_attention``).
- ``AttentionArrays`` holds the optional array arguments, already shaped as below.
- ``AttentionStatics`` holds everything static (hashable, so it can key caches and custom_vjp
  nondiff args).
- Backends return ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``; LSE is -inf for a
  row with no key left to attend to, and that row's output is 0. float64 inputs (under
  ``jax_enable_x64``; only the XLA reference serves them) compute and return their LSE in
  float64 (`accum_dtype`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

# What `jax.default_backend()` ("gpu") or a lowering target ("cuda") calls an NVIDIA GPU.
GPU_PLATFORMS = ("cuda", "gpu")
# The CUDA arch assumed when lowering without a GPU and without $CUTE_DSL_ARCH (the H200).
DEFAULT_CUDA_ARCH = (9, 0)
# The CUDA archs the Pallas (Triton) helper kernels of the FP8 path (the prologue, the
# keys-major copies) have run on; elsewhere their XLA forms serve.
TRITON_HELPER_ARCHS = ((9, 0),)


def accum_dtype(dtype):
    """The dtype softmax statistics and accumulations are kept in for inputs of `dtype`:
    float32, or float64 for float64 inputs (a float32 LSE would cost a float64 call its
    precision in the backward's exp(s - lse))."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def env_flag(name: str) -> bool:
    """An on / off environment setting: 1, true, yes, on (any case) is on; unset, empty, 0,
    false, no, off is off; anything else raises ValueError naming the variable."""
    import os
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${name}={os.environ[name]!r} is neither on (1, true, yes, on) nor off "
                     f"(0, false, no, off, empty)")


def cuda_arch() -> tuple[int, int]:
    """The CUDA arch the kernels are built for: ``$CUTE_DSL_ARCH`` (the project's way of naming
    the target when lowering on a machine without a GPU, e.g. ``sm_90a``), else the local GPU's,
    else `DEFAULT_CUDA_ARCH`."""
    import os
    env = os.environ.get("CUTE_DSL_ARCH", "")
    digits = "".join(ch for ch in env if ch.isdigit())
    if len(digits) >= 2:
        return int(digits[:-1]), int(digits[-1])
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu" and getattr(dev, "compute_capability", None):
            major, minor = dev.compute_capability.split(".")
            return int(major), int(minor)
    except Exception:  # noqa: BLE001 - no GPU here: fall through to the default
        pass
    return DEFAULT_CUDA_ARCH


def triton_helpers_run(platform: str, x=None) -> bool:
    """Whether the FP8 path's Pallas (Triton) helpers take a call: a CUDA platform, an arch
    of `TRITON_HELPER_ARCHS`, and (given an operand `x`) not a possibly sharded trace."""
    return (platform in GPU_PLATFORMS and tuple(cuda_arch()) in TRITON_HELPER_ARCHS
            and (x is None or not sharded_trace(x)))


def sharded_trace(x) -> bool:
    """A jit trace in a multi-device process: the operand may be sharded (`jaxflash.sharding`),
    so an opaque kernel would make the SPMD partitioner gather it."""
    try:
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer as tracer
    except ImportError:  # pragma: no cover - moved in some jax version: assume it may be
        tracer = jax.core.Tracer
    return jax.device_count() > 1 and isinstance(x, tracer)


class AttentionArrays(NamedTuple):
    """Optional array operands in canonical shapes (None where absent).

    bias: ``[Bb, Nb, T, S]`` float, with Bb in {1, B} and Nb in {1, N} (broadcast over T, S done).
    mask: ``[Bb, Nb, T, S]`` bool, True = attend.
    q_seqlen / kv_seqlen: ``[B]`` int32.
    alibi_slopes: ``[N]`` float32.
    q_segment_ids / kv_segment_ids: ``[B, T]`` / ``[B, S]`` int32 (both or neither).
    q_scale / k_scale / v_scale: FP8 calls only (``AttentionStatics.fp8`` set): float32
    dequantization scales ``[B, N, ceil(T / q_block)]``, ``[B, K, ceil(S / k_block)]``,
    ``[B, K, ceil(S / v_block)]`` (blocks of `Fp8Spec`); operand value = code * scale of its
    (batch, head, row // block). Per-tensor and per-head scales arrive broadcast to this
    layout with one block (block = the whole sequence).
    mod_aux: the flat leaves of the mods' aux tuple (``statics.mods`` rebuilds the tuple);
        floating leaves get gradients.
    block_mask: a `jaxflash.mods.BlockMask` (its arrays are int32; block sizes static), or None.
    mod_offsets: ``[2]`` int32, the global (batch, query head) index of this shard's first row
        and head, which the mods see (set per shard by `jaxflash.sharding`; None = 0, 0).
    """

    bias: Optional[jax.Array] = None
    mask: Optional[jax.Array] = None
    q_seqlen: Optional[jax.Array] = None
    kv_seqlen: Optional[jax.Array] = None
    alibi_slopes: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    q_scale: Optional[jax.Array] = None
    k_scale: Optional[jax.Array] = None
    v_scale: Optional[jax.Array] = None
    mod_aux: tuple = ()
    block_mask: Optional[object] = None
    mod_offsets: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """The FP8 part of a call (static; see `jaxflash.fp8` for the numerics).

    q/k/v_dtype: "float8_e4m3fn" or "float8_e5m2", the dtypes of the canonical q, k, v.
    q/k/v_block: sequence rows per scale in the canonical scale arrays (`AttentionArrays`);
    the whole (padded) sequence for per-tensor / per-head scales.
    granularity: the caller's layouts ("tensor" | "head" | "block") for q, k, v (explain).
    out_dtype: the output's dtype (bfloat16 by default).
    source: "fp8" (the caller passed FP8 tensors and scales) or "quantized" (precision="fp8":
    jaxflash quantized float inputs itself; gradients are straight-through to those inputs).
    hadamard: whether Q and K went through the random-sign Hadamard transform first (it
    cancels in Q K^T, so a backend need not know; `explain` says it).
    do_dtype: the backward's format for dO ("float8_e5m2", the recipe's default, or
    "float8_e4m3fn": finer, with a narrower range under the same per-block amax scales).
    """

    q_dtype: str = "float8_e4m3fn"
    k_dtype: str = "float8_e4m3fn"
    v_dtype: str = "float8_e4m3fn"
    q_block: int = 128
    k_block: int = 128
    v_block: int = 128
    granularity: tuple[str, str, str] = ("block", "block", "block")
    out_dtype: str = "bfloat16"
    source: str = "fp8"
    hadamard: bool = False
    do_dtype: str = "float8_e5m2"


@dataclasses.dataclass(frozen=True)
class AttentionStatics:
    """Static, hashable part of a call."""

    scale: float
    is_causal: bool = False
    # (left, right): query i may attend key j iff i - left <= j <= i + right.
    window: Optional[tuple[int, int]] = None
    softcap: Optional[float] = None
    # Bitwise-reproducible gradients (backends without atomics are deterministic anyway).
    deterministic: bool = False
    # Set for FP8 calls (q, k, v FP8 with scales in `AttentionArrays`); None otherwise.
    fp8: Optional[Fp8Spec] = None
    # score_mod / mask_mod: a `jaxflash.mods.ModSpec` (hashable by the mods' code), or None.
    mods: Optional[object] = None
    # Set when a mask_mod was found equal to a built-in mask and runs as it (`explain` says so).
    mods_note: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to say whether it can serve a call (no arrays)."""

    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    statics: AttentionStatics
    bias_shape: Optional[tuple[int, ...]] = None
    has_mask: bool = False
    has_q_seqlen: bool = False
    has_kv_seqlen: bool = False
    has_alibi: bool = False
    has_segments: bool = False
    platform: str = "cpu"
    # (tm, tn) of the call's block mask, or None.
    block_sparse: Optional[tuple[int, int]] = None

    @property
    def mods(self):
        """The call's `jaxflash.mods.ModSpec`, or None."""
        return self.statics.mods

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def symbolic(self) -> tuple[str, ...]:
        """The dims that are symbolic (`jax.export` shape polymorphism), by name."""
        dims = (("batch", self.batch), ("q_len", self.q_len), ("kv_len", self.kv_len))
        return tuple(n for n, d in dims + tuple(("bias", d) for d in self.bias_shape or ())
                     if not isinstance(d, int))

    def features(self) -> tuple[str, ...]:
        """Names of the features in use, for messages and kernel variant keys."""
        f = []
        if self.statics.is_causal:
            f.append("causal")
        if self.statics.window is not None:
            f.append("window")
        if self.statics.softcap is not None:
            f.append("softcap")
        if self.has_alibi:
            f.append("alibi")
        if self.bias_shape is not None:
            f.append("bias")
        if self.has_mask:
            f.append("mask")
        if self.has_segments:
            f.append("segment_ids")
        if self.has_q_seqlen or self.has_kv_seqlen:
            f.append("seq_lengths")
        if self.statics.fp8 is not None:
            f.append("fp8")
        mods = self.statics.mods
        if mods is not None and mods.score_mod is not None:
            f.append("score_mod")
        if mods is not None and mods.mask_mod is not None:
            f.append("mask_mod")
        if self.block_sparse is not None:
            f.append("block_mask")
        return tuple(f)

    @classmethod
    def from_arrays(cls, q, k, v, arrays: AttentionArrays, statics: AttentionStatics,
                    platform: str) -> "Problem":
        B, T, N, H = q.shape
        _, S, K, _ = k.shape
        return cls(
            batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K, head_dim=H,
            head_dim_v=v.shape[-1], dtype=str(q.dtype), statics=statics,
            bias_shape=None if arrays.bias is None else tuple(arrays.bias.shape),
            has_mask=arrays.mask is not None,
            has_q_seqlen=arrays.q_seqlen is not None,
            has_kv_seqlen=arrays.kv_seqlen is not None,
            has_alibi=arrays.alibi_slopes is not None,
            has_segments=arrays.q_segment_ids is not None,
            platform=platform,
            block_sparse=None if arrays.block_mask is None else tuple(arrays.block_mask.block),
        )
