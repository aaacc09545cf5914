"""Block sizes and launch parameters of the Pallas kernels, per pass, head dim and platform.

Frozen and validated at construction, so a bad table entry fails at import, not inside a
lowering. The GPU figures were tuned on an H200 (see `benchmarks/pallas_tune.py`); the interpret
figures are small so that CPU tests cover several blocks and tails at tiny sizes.
"""
from __future__ import annotations

import dataclasses

MAX_HEAD_DIM = 256


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def padded_head_dim(d: int) -> int:
    """Head dims are loaded as power-of-two tiles of at least 16 (what Triton's dot needs);
    the padded columns are masked on load (read as 0) and on store (never written)."""
    p = 16
    while p < d:
        p *= 2
    return p


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """One kernel's tile: ``block_q`` query rows x ``block_k`` key rows, plus Triton's launch
    parameters (ignored in interpret mode and on TPU)."""

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if not (_pow2(b) and b >= 16):
                raise ValueError(f"{name} must be a power of two >= 16; got {b}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16; got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8]; got {self.num_stages}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of every kernel: forward, backward dK/dV (iterates query blocks for one key
    block), backward dQ (iterates key blocks for one query block), dbias (like dQ)."""

    fwd: PassConfig
    dkdv: PassConfig
    dq: PassConfig
    dbias: PassConfig


_INTERPRET = Config(
    fwd=PassConfig(16, 32), dkdv=PassConfig(16, 32), dq=PassConfig(16, 32),
    dbias=PassConfig(16, 32))

# Keyed by the larger padded head dim of (H, Hv), for 2-byte inputs on NVIDIA GPUs. D=128 and
# D=256 are the per-kernel winners of an H200 sweep at B*S=16k, H*D=2048, bf16 (2026-11-30,
# benchmarks/results/pallas-h200-2026-11-30.json, "tune" rows): fwd 496 / dK,dV 407 / dQ 491
# TFLOP/s at D=128, fwd 448 / dK,dV 170 / dQ 206 at D=256. Smaller head dims reuse D=128's
# tiles (their registers are lighter still).
_D128 = Config(fwd=PassConfig(128, 128, 8, 3), dkdv=PassConfig(64, 128, 8, 3),
               dq=PassConfig(128, 64, 8, 3), dbias=PassConfig(64, 64, 4, 2))
_GPU_16BIT = {
    16: _D128,
    32: _D128,
    64: _D128,
    128: _D128,
    # D=256: the dK/dV accumulators (2 x block_k x 256 float32) bound the key block.
    256: Config(fwd=PassConfig(128, 64, 8, 2), dkdv=PassConfig(32, 32, 4, 3),
                dq=PassConfig(64, 64, 8, 2), dbias=PassConfig(32, 32, 4, 2)),
}


def _halve(c: PassConfig) -> PassConfig:
    return dataclasses.replace(c, block_q=max(16, c.block_q // 2),
                               block_k=max(16, c.block_k // 2), num_stages=min(c.num_stages, 2))


def choose(head_dim: int, head_dim_v: int, dtype: str, *, interpret: bool) -> Config:
    """The config for a call. float32 inputs use tiles half as large (twice the bytes)."""
    if interpret:
        return _INTERPRET
    d = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dims up to {MAX_HEAD_DIM} are supported; got {d}")
    cfg = _GPU_16BIT[d]
    if str(dtype) == "float32":
        cfg = Config(*(_halve(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)))
    return cfg
