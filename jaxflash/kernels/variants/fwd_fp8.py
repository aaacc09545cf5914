"""Static configuration of the Hopper FP8 forward kernel (`sm90.fwd_fp8.FlashFwdSm90Fp8`).

The FP8 kernel is the bf16 forward (`FwdConfig`, same masks, same consumer mainloop) with e4m3
inputs: both GEMMs are FP8 wgmma (k = 32), V is transposed in shared memory by the producer
warpgroup (FP8 wgmma reads only K-major operands, and V's keys are its rows), P goes to e4m3 in
registers, and O leaves in a 16-bit type with the inputs' descales applied. A subclass of
`FwdConfig` so every mask / schedule field keeps its meaning; `check` refuses the schedules the
FP8 kernel does not implement (persistent loops, tile pipe, tiles other than 128 rows, ALiBi).

Shared memory: Q + stages * (K + V as loaded + V transposed), one byte an element; O (16-bit)
reuses the loaded-V buffers (free once the last block is transposed, and as large as O at 2
stages of 128 keys: 2 * 128 * Hv = 128 * Hv * 2 bytes), extended over the V^T buffers when
smaller (the consumers then meet before writing it).
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.variants.fwd import SMEM_LIMIT_BYTES, FwdConfig

FP8_DTYPES = ("float8_e4m3fn",)
OUT_DTYPES = ("bfloat16", "float16")
FP8_HEAD_DIMS = (64, 128, 256)
# Per head dim: (tile_m, tile_n). 128 keys a block everywhere: the FP8 operands halve the
# shared memory of the bf16 tiles, and the 64 x tile_n score accumulator plus the e4m3 P (a
# quarter of it) fit beside the 64 x 256 output accumulator at 240 registers.
_FP8_TILES = {64: (128, 128), 128: (128, 128), 256: (128, 128)}
# Runtime tensors of a launch after the optional length / segment inputs: the descales
# (float32; the dequantization factors q_scale etc. multiplied back in), per (batch, head).
DESCALES = ("q_descale", "k_descale", "v_descale")


@dataclasses.dataclass(frozen=True)
class Fp8FwdConfig(FwdConfig):
    """One compiled variant of `FlashFwdSm90Fp8`.

    dtype: q, k, v element type ("float8_e4m3fn"). out_dtype: O's ("bfloat16" / "float16");
    lse is float32. The descales are runtime inputs q_descale [B, N], k_descale [B, K],
    v_descale [B, K] float32 (per-tensor and per-head scales are broadcast to them in XLA):
    scores = q_descale * k_descale * (Q8 K8^T), O = v_descale * (P8 V8) / rowsum.
    Other fields: `FwdConfig` (ALiBi, persistence, the tile pipe and 64/192/256-row tiles
    are refused).
    """

    dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"

    def __post_init__(self):
        tm, tn = _FP8_TILES.get(self.head_dim, (128, 128))
        if self.tile_m is None:
            object.__setattr__(self, "tile_m", tm)
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", tn)
        super().__post_init__()

    def check(self) -> tuple[bool, str]:
        if self.dtype not in FP8_DTYPES:
            return False, f"dtype {self.dtype} not in {FP8_DTYPES}"
        if self.out_dtype not in OUT_DTYPES:
            return False, f"out_dtype {self.out_dtype} not in {OUT_DTYPES}"
        if self.head_dim not in FP8_HEAD_DIMS:
            return False, f"head_dim {self.head_dim} not in {FP8_HEAD_DIMS} for FP8"
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        if self.tile_m != 128 or self.ctas_per_sm != 1:
            return False, (f"FP8: tile_m {self.tile_m} (ctas_per_sm {self.ctas_per_sm}); only "
                           "128-row tiles, one CTA per SM")
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            return False, (f"tile_n {self.tile_n} must be a multiple of 32 in [32, 256] (the "
                           "FP8 PV GEMM's k-block is 32 keys)")
        if self.persistent or self.tile_pipe or self.wg_epilogue or self.tile_order != "auto":
            return False, ("FP8: no persistent loop, tile pipe, per-warpgroup epilogue or "
                           "paired tile order (the transposing producer is written for one tile "
                           "per CTA)")
        if self.has_alibi:
            return False, "FP8: no ALiBi"
        if self.num_stages != 2:
            return False, f"FP8: num_stages {self.num_stages} (only 2)"
        if self.num_stages * self.tile_n < self.tile_m:
            return False, (f"FP8: tile_n {self.tile_n} too small for O to fit in the V buffers "
                           f"(stages x tile_n >= tile_m)")
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B "
                           f"(tile {self.tile_m}x{self.tile_n}, head dim {self.head_dim})")
        return True, ""

    @property
    def o_in_vraw(self) -> bool:
        """O (16-bit) fits in the loaded-V buffers, which are free at the epilogue."""
        return self.num_stages * self.tile_n >= 2 * self.tile_m

    def smem_bytes(self, separate_o=None) -> int:
        q = self.tile_m * self.head_dim
        k = self.num_stages * self.tile_n * self.head_dim
        v = self.num_stages * self.tile_n * self.head_dim_v
        return q + k + 2 * v + 1024  # + barriers and alignment (O reuses the V buffers)

    @property
    def separate_o(self) -> bool:
        return False

    @property
    def key(self) -> str:
        base = super().key  # fwd_sm90_<dtype>_h..
        short = {"float8_e4m3fn": "e4m3"}[self.dtype]
        out = {"bfloat16": "bf16", "float16": "f16"}[self.out_dtype]
        return base.replace(f"fwd_sm90_{self.dtype}_", f"fwd8_sm90_{short}_o{out}_", 1)


def can_implement(config: Fp8FwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the FP8 forward kernel serves a problem: a config, or keyword facts dtype,
    head_dim, head_dim_v, features (`jaxflash._types.Problem.features()` names)."""
    if config is not None:
        return config.check()
    dtype = problem.get("dtype")
    if dtype not in FP8_DTYPES:
        return False, f"dtype {dtype} not supported by the FP8 kernel (only {FP8_DTYPES})"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in FP8_HEAD_DIMS:
        return False, f"head dim {hd} not supported in FP8 (only {FP8_HEAD_DIMS})"
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    unsupported = [f for f in problem.get("features", ())
                   if f not in ("causal", "window", "softcap", "seq_lengths", "segment_ids")]
    if unsupported:
        return False, f"features {unsupported} not supported by the FP8 forward kernel"
    return True, ""
