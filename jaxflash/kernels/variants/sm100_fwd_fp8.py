"""Static configuration of the Blackwell FP8 (e4m3) forward (`sm100.fwd_fp8.FlashFwdSm100Fp8`).

The sm_100a forward (`Sm100FwdConfig`: same warp roles, masks, tensor-memory layout) with e4m3
Q, K, V: both GEMMs are ``tcgen05.mma ... kind::f8f6f4`` (K = 32 a step). Unlike Hopper's FP8
wgmma, tcgen05 reads 8-bit operands MN-major from shared memory, so V is the PV MMA's B operand
as loaded (head dim contiguous): no transpose. P is stored over S in tensor memory as e4m3, four
to a 32-bit column (tile_n / 4 columns), and read from there as the PV MMA's A operand.

Numerics: the FP8 contract (`jaxflash.fp8.contract`): P relative to the exact running row max
(``rescale_threshold`` must be 0: with conditional rescaling P could reach 2^(8 + threshold),
past e4m3's 448), scaled by 2^8 before the e4m3 conversion, the row sum from the same unrounded
P (it carries the 2^8, which cancels in O; the LSE takes it out). Scales in the contract's
canonical layout ``[B, heads, nb]`` float32: one per (batch, head) (nb = 1), or one per 128
rows (``q_blocks`` / ``k_blocks`` / ``v_blocks``: the kernel's 128-row tiles and 128-key blocks,
the contract's blocks). Key tiles are 128 at every head dim (the contract's softmax tile):
one-byte operands leave room for them in shared memory, and at head dim 256 S0 | S1 | O fill the
512 tensor-memory columns exactly.
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.variants import tmem_plan
from jaxflash.kernels.variants.fwd_fp8 import FP8_HEAD_DIMS
from jaxflash.kernels.variants.sm100_fwd import TILE_M, Sm100FwdConfig

FP8_DTYPES = ("float8_e4m3fn",)
OUT_DTYPES = ("bfloat16", "float16")
# Per head dim: K/V stages (tile_n 128). Shared memory = Q + stages * (K + V), one byte an
# element: hd 64 8 + 4 x 16 KB, hd 128 16 + 3 x 32, hd 256 32 + 2 x 64.
_FP8_STAGES = {64: 4, 128: 3, 256: 2}
FP8_TILE_N = 128
# P scaled by 2^8 before e4m3 (`jaxflash.fp8.contract.P_SCALE_LOG2`; a kernel may not import
# that layer: tests/kernels/test_sm100_fp8_compile.py holds the two equal)
P_SHIFT_LOG2 = 8


@dataclasses.dataclass(frozen=True)
class Sm100Fp8FwdConfig(Sm100FwdConfig):
    """One compiled variant of `FlashFwdSm100Fp8`.

    dtype: q, k, v ("float8_e4m3fn"); out_dtype: O's ("bfloat16" / "float16"), lse float32.
    q_blocks / k_blocks / v_blocks: that operand's scale is one per 128 rows ([B, heads, nb])
    rather than one per (batch, head). Other fields: `Sm100FwdConfig` (no ALiBi;
    ``rescale_threshold`` 0 only).
    """

    dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"
    rescale_threshold: float = 0.0
    q_blocks: bool = False
    k_blocks: bool = False
    v_blocks: bool = False
    # (not a field) tcgen05 reads V MN-major as it lies, so V never arrives pre-transposed; the
    # launch and the inputs shared with the Hopper FP8 kernel ask
    v_transposed = False

    def __post_init__(self):
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", FP8_TILE_N)
        if self.num_stages is None:
            object.__setattr__(self, "num_stages", _FP8_STAGES.get(self.head_dim, 2))
        super().__post_init__()

    def tmem_plan(self) -> tmem_plan.TmemPlan:
        """The forward's plan with 8-bit P: tile_n / 4 columns over the start of each S."""
        base = tmem_plan.forward_plan(self.tile_n, self.head_dim_v)
        p_cols = self.tile_n // 4
        regions = tuple(dataclasses.replace(r, cols=p_cols) if r.kind == "P" else r
                        for r in base.regions)
        order = tuple(op for op in base.softmax_order if op[0] == "load")
        order += tuple(("store", c, min(32, p_cols - c)) for c in range(0, p_cols, 32))
        return tmem_plan.TmemPlan(regions, order, base.alloc_cols)

    def check(self) -> tuple[bool, str]:
        if self.dtype not in FP8_DTYPES:
            return False, f"dtype {self.dtype} not in {FP8_DTYPES}"
        if self.out_dtype not in OUT_DTYPES:
            return False, f"out_dtype {self.out_dtype} not in {OUT_DTYPES}"
        if self.head_dim not in FP8_HEAD_DIMS:
            # the FP8 call rules are the Hopper FP8 forward's (`choose.sm100_fp8_forward_config`)
            return False, f"head_dim {self.head_dim} not in {FP8_HEAD_DIMS} for FP8"
        if self.tile_n != FP8_TILE_N:
            return False, (f"tile_n {self.tile_n}: the FP8 forward's key tile is the contract's "
                           f"{FP8_TILE_N}-key softmax tile")
        if self.rescale_threshold != 0.0:
            return False, (f"rescale_threshold {self.rescale_threshold}: FP8 keeps P <= 2^8 "
                           "(e4m3's 448), so the row max is exact (0)")
        if self.has_alibi:
            return False, "FP8: no ALiBi"
        if self.two_cta:
            return False, "FP8: no two_cta variant (1-CTA MMAs only)"
        return self.check_machine()

    def smem_bytes(self) -> int:
        q = TILE_M * self.head_dim
        kv = self.num_stages * self.tile_n * (self.head_dim + self.head_dim_v)
        return q + kv + 4096

    @property
    def key(self) -> str:
        base = super().key.replace(f"fwd_sm100_{self.dtype}_", "fwd8_sm100_e4m3_o"
                                   + {"bfloat16": "bf16", "float16": "f16"}[self.out_dtype]
                                   + "_", 1)
        blocks = "".join(n for n, on in (("q", self.q_blocks), ("k", self.k_blocks),
                                            ("v", self.v_blocks)) if on)
        return base + (f"_sb{blocks}" if blocks else "")
