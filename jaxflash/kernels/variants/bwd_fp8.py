"""Static configuration of the Hopper FP8 backward kernel (`sm90.bwd_fp8.FlashBwdSm90Fp8`).

The bf16 backward's scheme (`BwdConfig`: one CTA per 128-key block, two 64-key consumer
warpgroups, a loop over the query blocks of the GQA group, dK / dV in registers, dQ by bulk
reduce-adds) with FP8 operands: E4M3 Q, K, V, P and dS, E5M2 (or E4M3) dO, float32
accumulation. FP8 wgmma reads only K-major operands, so the three GEMMs whose k index is not
the head dim take transposed copies that XLA writes in the same pass that quantizes dO
(`jaxflash.kernels.call`): Q^T and dO^T (head dim x queries) for dK += dS^T Q and
dV += P^T dO, K^T (head dim x keys) for dQ = dS K. Their k positions are permuted within each
16 so that P^T / dS^T go from the accumulator to the FP8 A registers without moving data
(`layouts.acc_as_fp8_operand_a`) and dS reaches shared memory in 16-bit stores
(`sm90.bwd_fp8`'s docstring gives both orders; `bwd_fp8_launch` applies them).

Scales: the kernel reads one float32 per (batch, head, step of tile_m queries) for q and dO
and one per (batch, kv head, 128-key block) for k and v; the launch expands per-tensor /
per-head / per-block scales into these. dS gets one scale per tile_m x 128 block (the amax of
the block, reduced over both consumer warpgroups before the convert: the contract's
BWD_DS_Q_TILE x BWD_KV_TILE).

Head dim 256 (``split == "headdim"``, `sm90.bwd_fp8_wide.FlashBwdSm90Fp8Wide`): the dK + dV
accumulators of 64 keys per warpgroup (hd/2 + hd/2 floats a thread) do not fit beside S^T and
dP^T, so as the bf16 `FlashBwdSm90Wide` the CTA takes ``tile_n`` = 64 keys and the two
consumer warpgroups split the head dim of dK, dV and dQ; P^T, dS^T and dS go through shared
memory. The dS scale block is then tile_m x 64 (the contract's `bwd_kv_tile`), k / v scales
are read per 64-key tile (a 128-key block covers two), one Q / dO stage (the float32 dQ tile
takes 64 KB).

Shared memory (bytes, hd 128, 2 stages): Q, Q^T, dO, dO^T 4 x 2 x 8 K; K, V, K^T 3 x 16 K; dS 2 x 8 K;
the float32 dQ tile 32 K; LSE / delta rows; ~165 KB. At hd 256, 1 stage: Q, Q^T, dO, dO^T 4 x 16 K;
K, V, K^T 3 x 16 K; P^T, dS^T, dS 3 x 4 K; dQ 64 K; ~194 KB.
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.variants.bwd import SMEM_LIMIT_BYTES, BwdConfig

FP8_BWD_HEAD_DIMS = (64, 128, 256)
DO_DTYPES = ("float8_e5m2", "float8_e4m3fn")
# Features the FP8 backward serves (the bf16 kernel's shared mask code).
FP8_BWD_FEATURES = ("causal", "window", "softcap", "seq_lengths", "segment_ids")
# Runtime scale tensors after the optional length / segment inputs, float32:
# q [B, N, ceil(T / tile_m)], do [B, N, ceil(T / tile_m)], k [B, K, ceil(S / tile_n)],
# v [B, K, ceil(S / tile_n)].
DESCALES = ("q_descale", "do_descale", "k_descale", "v_descale")
# Query rows per dO scale (the contract's BWD_Q_TILE; a sibling layer, not importable here:
# tests/kernels/test_fp8_bwd_compile.py holds them equal, and tile_m to its BWD_DS_Q_TILE).
DO_SCALE_ROWS = 128
# The least amax of a nonzero dO / dS block (the contract's BWD_AMAX_FLOOR): dV and dK are
# rescaled by the ratio of consecutive blocks' units, which must stay in float32's range.
AMAX_FLOOR = 2.0 ** -64


@dataclasses.dataclass(frozen=True)
class Fp8BwdConfig(BwdConfig):
    """One compiled variant of `FlashBwdSm90Fp8`.

    dtype: q, k, v element type ("float8_e4m3fn"); do_dtype: dO's ("float8_e5m2", or
    "float8_e4m3fn"). dq_acc is float32 in fragment order (``dq_flat``, as the bf16 kernel's),
    dk / dv float32 (gradients with respect to the dequantized operands; the scale of dK is
    applied in the kernel, dQ's softmax scale by the caller).
    tile_m: 64 queries per step (the dS scale block's rows); tile_n 128 keys, 2 stages, or at
    hd 256 (``split == "headdim"``) tile_n 64 and the stages that fit (1).
    Other fields: `BwdConfig` (ALiBi, mods, q_multicast, deterministic, early_dv refused).
    """

    dtype: str = "float8_e4m3fn"
    do_dtype: str = "float8_e5m2"
    dq_flat: bool = True

    def check(self) -> tuple[bool, str]:
        if self.dtype != "float8_e4m3fn":
            return False, f"FP8 backward: dtype {self.dtype} (only float8_e4m3fn q / k / v)"
        if self.do_dtype not in DO_DTYPES:
            return False, f"FP8 backward: do_dtype {self.do_dtype} not in {DO_DTYPES}"
        if self.head_dim not in FP8_BWD_HEAD_DIMS:
            return False, f"FP8 backward: head_dim {self.head_dim} not in {FP8_BWD_HEAD_DIMS}"
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        wide = self.split == "headdim"
        if self.tile_m != 64 or self.tile_n != (64 if wide else 128) or (
                not wide and self.num_stages != 2):
            return False, (f"FP8 backward: tile {self.tile_m}x{self.tile_n}, {self.num_stages} "
                           "stages (only 64 x 128 with 2 stages, 64 x 64 at head dims > 128)")
        extra = [n for n, on in (("ALiBi", self.has_alibi), ("score_mod", bool(self.score_mod)),
                                 ("mask_mod", bool(self.mask_mod)),
                                 ("deterministic", self.deterministic),
                                 ("early_dv", self.early_dv), ("q_multicast", self.q_multicast),
                                 ("tail_lpt", self.tail_lpt)) if on]
        if extra:
            return False, f"FP8 backward: {', '.join(extra)} not implemented"
        if not self.dq_flat:
            return False, "FP8 backward: dq_flat only (one bulk reduce of the dQ tile)"
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B"
        return True, ""

    def smem_bytes(self) -> int:
        h = self.head_dim
        kv = 3 * self.tile_n * h                          # K, V, K^T
        qdo = self.num_stages * self.tile_m * h * 4       # Q, Q^T, dO, dO^T
        ds = self.ds_buffers * self.tile_m * self.tile_n
        rows = 2 * self.num_stages * self.tile_m * 4 + 2 * 8 * 4
        dq = self.tile_m * h * 4
        return kv + qdo + ds + rows + dq + 1024

    @property
    def ds_buffers(self) -> int:
        """FP8 tile_m x tile_n tiles of the dS buffer: dS twice (key split), or P^T, dS^T and
        dS once each (head-dim split: the flush's barrier guards their reuse)."""
        return 2 if self.split == "keys" else 3

    @property
    def key(self) -> str:
        feats = [n for n, on in (("causal", self.is_causal), ("window", self.has_window),
                                 ("softcap", self.has_softcap), ("qlen", self.has_q_seqlen),
                                 ("kvlen", self.has_kv_seqlen), ("seg", self.has_segments))
                 if on]
        do = {"float8_e5m2": "e5m2", "float8_e4m3fn": "e4m3"}[self.do_dtype]
        return (f"bwd8_sm90_e4m3_do{do}_h{self.head_dim}_t{self.tile_m}x{self.tile_n}"
                f"s{self.num_stages}_{'-'.join(feats) or 'dense'}")


def can_implement(config: Fp8BwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the FP8 backward kernel serves a problem: a config, or keyword facts dtype,
    head_dim, head_dim_v, do_dtype, features."""
    if config is not None:
        return config.check()
    if problem.get("dtype") != "float8_e4m3fn":
        return False, f"dtype {problem.get('dtype')} (the FP8 backward takes e4m3 q / k / v)"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in FP8_BWD_HEAD_DIMS or hdv != hd:
        return False, f"head dim {hd} / {hdv} (the FP8 backward has {FP8_BWD_HEAD_DIMS})"
    if problem.get("do_dtype", "float8_e5m2") not in DO_DTYPES:
        return False, f"dO dtype {problem.get('do_dtype')} not in {DO_DTYPES}"
    unsupported = [f for f in problem.get("features", ()) if f not in FP8_BWD_FEATURES]
    if unsupported:
        return False, f"features {unsupported} not supported by the FP8 backward kernel"
    return True, ""
