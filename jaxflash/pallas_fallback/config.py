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
# D=256 are the per-kernel winners of an H200 sweep at B*S=16k, H*D=2048, bf16 (the Pallas
# result file's "tune" rows, indexed in benchmarks/results/README.md): fwd 496 / dK,dV 407 / dQ 491
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


# Shared memory per block (bytes) by CUDA compute capability (major, minor).
_SMEM = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 7): 166912, (8, 6): 101376,
         (8, 9): 101376, (7, 5): 65536, (7, 0): 98304}


def target_arch() -> tuple[int, int]:
    """The CUDA arch the kernels are built for (`jaxflash._types.cuda_arch`)."""
    from jaxflash._types import cuda_arch
    return cuda_arch()


def smem_bytes(kind: str, c: PassConfig, hp: int, hvp: int, itemsize: int,
               dense_bytes: int) -> int:
    """Estimated shared memory of one kernel: the tiles that stay resident plus `num_stages`
    copies of the tiles its loop streams (Triton's software pipelining). `dense_bytes` is the
    bytes per (query, key) element of the dense operands (bias itemsize + 1 for the int8 mask).
    It matches what was seen on an H200: 224 KB estimated fit for both the plain D=128 forward
    (128 x 128, 3 stages) and a bias+mask forward (128 x 64, 3 stages); a bias+mask forward
    estimated at 416 KB was refused (Triton asked for 345 KB of 227)."""
    bq, bk, st = c.block_q, c.block_k, c.num_stages
    dense = bq * bk * dense_bytes
    if kind == "fwd":
        return bq * hp * itemsize + st * (bk * (hp + hvp) * itemsize + dense)
    if kind == "dkdv":
        return bk * (hp + hvp) * itemsize + st * (bq * (hp + hvp) * itemsize + dense)
    if kind == "dq":
        return bq * (hp + hvp) * itemsize + st * (bk * (hp + hvp) * itemsize + dense)
    if kind == "dbias":  # everything is reloaded per (batch row, head) inside the key loop
        return bq * bk * 4 + st * ((bq + bk) * (hp + hvp) * itemsize + dense)
    raise ValueError(kind)


def fit(kind: str, c: PassConfig, hp: int, hvp: int, itemsize: int, dense_bytes: int,
        limit: int) -> PassConfig:
    """Shrink `c` until its estimate fits `limit`: fewer stages first (2), then the streamed
    block, then the resident one. Raises NotImplementedError if even 16 x 16 does not fit."""
    streamed = "block_q" if kind == "dkdv" else "block_k"
    resident = "block_k" if kind == "dkdv" else "block_q"
    while smem_bytes(kind, c, hp, hvp, itemsize, dense_bytes) > limit:
        if c.num_stages > 2:
            c = dataclasses.replace(c, num_stages=2)
        elif getattr(c, streamed) > 16:
            c = dataclasses.replace(c, **{streamed: getattr(c, streamed) // 2})
        elif getattr(c, resident) > 16:
            c = dataclasses.replace(c, **{resident: getattr(c, resident) // 2})
        elif c.num_stages > 1:
            c = dataclasses.replace(c, num_stages=1)
        else:
            raise NotImplementedError(
                f"the {kind} kernel's 16 x 16 tiles need more shared memory than the "
                f"{limit} bytes this GPU has (head dims padded to {hp}/{hvp})")
    return c


def choose(head_dim: int, head_dim_v: int, dtype: str, *, interpret: bool,
           dense_bytes: int = 0, arch: tuple[int, int] | None = None) -> Config:
    """The config for a call. float32 inputs start from tiles half as large (twice the bytes);
    then every kernel is shrunk to fit the target GPU's shared memory, which matters with a
    dense bias/mask (streamed per tile) and on GPUs with less shared memory than the H200."""
    if interpret:
        return _INTERPRET
    d = max(padded_head_dim(head_dim), padded_head_dim(head_dim_v))
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dims up to {MAX_HEAD_DIM} are supported; got {d}")
    cfg = _GPU_16BIT[d]
    itemsize = 4 if str(dtype) == "float32" else 2
    if itemsize == 4:
        cfg = Config(*(_halve(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)))
    arch = arch or target_arch()
    limit = _SMEM.get(arch, min(_SMEM.values()) if arch < (9, 0) else _SMEM[(9, 0)])
    hp, hvp = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    return Config(*(fit(f.name, getattr(cfg, f.name), hp, hvp, itemsize, dense_bytes, limit)
                    for f in dataclasses.fields(cfg)))


def within_blocks(cfg: Config, tm: int, tn: int) -> Config:
    """`cfg` with the forward, dQ and dK / dV tiles capped at a block mask's ``tm x tn``
    (both powers of two, so the kernel's blocks divide the mask's); launch parameters kept."""
    def cap(c):
        return dataclasses.replace(c, block_q=min(c.block_q, tm), block_k=min(c.block_k, tn))
    return dataclasses.replace(cfg, fwd=cap(cfg.fwd), dq=cap(cfg.dq), dkdv=cap(cfg.dkdv))
