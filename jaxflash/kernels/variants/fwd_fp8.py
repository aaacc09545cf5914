"""Static configuration of the Hopper FP8 forward kernel (`sm90.fwd_fp8.FlashFwdSm90Fp8`).

The FP8 kernel is the bf16 forward (`FwdConfig`, same masks, same consumer mainloop) with e4m3
inputs: both GEMMs are FP8 wgmma (k = 32), V is transposed in shared memory by the producer
warpgroup (FP8 wgmma reads only K-major operands, and V's keys are its rows), P goes to e4m3 in
registers, and O leaves in a 16-bit type with the inputs' descales applied. A subclass of
`FwdConfig` so every mask / schedule field keeps its meaning; `check` refuses the schedules the
FP8 kernel does not implement (tile pipe, tiles other than 128 rows, ALiBi).

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
# Runtime tensors of a launch after the optional length / segment inputs: the dequantization
# scales (float32), [B, heads, nb]: one block (nb = 1) or one per tile of rows (`*_blocks`).
DESCALES = ("q_descale", "k_descale", "v_descale")


@dataclasses.dataclass(frozen=True)
class Fp8FwdConfig(FwdConfig):
    """One compiled variant of `FlashFwdSm90Fp8`.

    dtype: q, k, v element type ("float8_e4m3fn"). out_dtype: O's ("bfloat16" / "float16");
    lse is float32. The scales are runtime inputs q_descale [B, N, nq], k_descale [B, K, nk],
    v_descale [B, K, nv] float32 (`jaxflash._types.AttentionArrays`' canonical layout):
    scores = q_scale * k_scale * (Q8 K8^T), O = sum_j P8_j (v_scale_j V8_j) / rowsum.
    q_blocks / k_blocks / v_blocks: that scale has one block per tile of rows (tile_m for q,
    tile_n for k and v: the contract's 128-row blocks) instead of one (nb = 1) for the whole
    sequence. k blocks multiply each key block's scores (one FMUL a score); v blocks fold
    v_scale[j+1] / v_scale[j] into the per-row O rescale (so O accumulates in the current
    block's units and P keeps the contract's rounding); q blocks cost nothing (one per tile).
    tile_m: 128, or 192 at head dim 64 (three consumer warpgroups at 160 registers, as the bf16
    kernel's hd 64 picks). persistent: one CTA per SM loops over tiles (O in its own buffer, so only where it fits:
    up to hd 128): the producer warpgroup walks the same tile sequence.
    v_transposed: V arrives as V^T [B, K, Hv, Sp] (keys contiguous, in the order P is packed
    in: `fp8_v_layout`; Sp = S rounded up to 16), written by the XLA step before the launch
    (fused into `precision="fp8"`'s quantization), and TMA loads it as the PV GEMM reads it:
    the producer warpgroup transposes nothing.
    Other fields: `FwdConfig` (ALiBi, the tile pipe and 64/192/256-row tiles are refused;
    lazy_rescale not with v blocks).
    """

    dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"
    q_blocks: bool = False
    k_blocks: bool = False
    v_blocks: bool = False
    v_transposed: bool = False

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
        if self.ctas_per_sm != 1 or not (self.tile_m == 128 or (self.tile_m == 192
                                                                 and self.head_dim == 64)):
            return False, (f"FP8: tile_m {self.tile_m} (ctas_per_sm {self.ctas_per_sm}); "
                           "128-row tiles (192 at head dim 64), one CTA per SM")
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            return False, (f"tile_n {self.tile_n} must be a multiple of 32 in [32, 256] (the "
                           "FP8 PV GEMM's k-block is 32 keys)")
        if not self.v_transposed and (self.tile_n // 32) * (self.head_dim_v // 16) % 4:
            return False, (f"tile_n {self.tile_n} x head dim {self.head_dim_v}: the V transpose "
                           "splits (tile_n / 32) x (hdv / 16) block groups over 4 warps")
        if self.tile_pipe or self.wg_epilogue or self.tile_order != "auto":
            return False, ("FP8: no tile pipe, per-warpgroup epilogue or paired tile order")
        if self.has_alibi or self.score_mod or self.mask_mod:
            return False, "FP8: no ALiBi, score_mod or mask_mod"
        if self.v_blocks and self.lazy_rescale:
            return False, ("FP8: lazy_rescale with v_blocks (every block rescales O by the "
                           "ratio of consecutive v scales)")
        if self.num_stages != 2:
            return False, f"FP8: num_stages {self.num_stages} (only 2)"
        if self.num_stages * self.tile_n < self.tile_m and not self.persistent:
            return False, (f"FP8: tile_n {self.tile_n} too small for O to fit in the V buffers "
                           f"(stages x tile_n >= tile_m)")
        if self.tile_m == 192 and self.mask_select:
            return False, ("mask_select is always on at tile_m 192 (drop the flag: the key "
                           "would name a second copy of one binary)")
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B "
                           f"(tile {self.tile_m}x{self.tile_n}, head dim {self.head_dim})")
        return True, ""

    @property
    def o_in_vraw(self) -> bool:
        """O (16-bit) staged in the loaded-V buffers (free at the epilogue, and large enough)
        rather than over them and the V^T buffers; with persistence O has its own buffer."""
        return not self.persistent and self.num_stages * self.tile_n >= 2 * self.tile_m

    def smem_bytes(self, separate_o=None) -> int:
        q = self.tile_m * self.head_dim
        k = self.num_stages * self.tile_n * self.head_dim
        v = self.num_stages * self.tile_n * self.head_dim_v
        # O reuses the V buffers, except in the persistent loop (the next tile's V loads
        # while this tile's O is stored)
        o = self.tile_m * self.head_dim_v * 2 if self.persistent else 0
        return q + k + 2 * v + o + 1024  # + barriers and alignment

    @property
    def separate_o(self) -> bool:
        return self.persistent

    @property
    def key(self) -> str:
        base = super().key  # fwd_sm90_<dtype>_h..
        short = {"float8_e4m3fn": "e4m3"}[self.dtype]
        out = {"bfloat16": "bf16", "float16": "f16"}[self.out_dtype]
        blocks = "".join(n for n, on in (("q", self.q_blocks), ("k", self.k_blocks),
                                            ("v", self.v_blocks)) if on)
        base = base.replace(f"fwd_sm90_{self.dtype}_", f"fwd8_sm90_{short}_o{out}_", 1)
        return base + (f"_sb{blocks}" if blocks else "") + ("_vt" if self.v_transposed else "")


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
