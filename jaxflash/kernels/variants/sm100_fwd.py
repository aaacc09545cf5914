"""Static configuration of the Blackwell (sm_100a) forward kernel: `Sm100FwdConfig` (DSL-free).

The feature fields carry the names of the Hopper `FwdConfig`'s, so the launch description, the
XLA-side inputs (`fwd_launch.fwd_inputs`) and the segment summaries are shared. What differs is
the machine: 128 query rows per CTA in tensor memory (`tmem_plan`), 3 warpgroups (softmax,
correction + epilogue, and one holding the MMA and load warps), key tiles sized by shared memory.

These kernels are compiled and instruction-checked here only: no Blackwell GPU has run them, so
dispatch gates them (`policy.verified`) until one does.
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.variants import tmem_plan

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 227 * 1024
TILE_M = 128
# Per head dim: (tile_n, K/V stages). Shared memory = Q + stages * (K + V) (+ 4 KB): hd 64
# 16 + 3 x 32 KB, hd 96 24 + 3 x 48, hd 128 32 + 2 x 64, hd 192 (64-key tiles) 48 + 3 x 48,
# hd 256 (64-key tiles) 64 + 2 x 64 KB. At hd 192 two 128-key stages (48 + 2 x 96 = 240 KB) do
# not fit, and one would stall every QK MMA on its K load. Tensor memory: 2 S buffers + O =
# 320 / 352 / 384 / 320 / 384 columns.
_TILES = {64: (128, 3), 96: (128, 3), 128: (128, 2), 192: (64, 3), 256: (64, 2)}
# 2-CTA: each CTA holds half of every K and V tile, so hd 192 keeps 128-key tiles (per CTA
# 48 + 3 x 48 KB; tensor memory 128 + 128 + 192 = 448 columns). Other head dims: `_TILES`.
_TILES_2CTA = {192: (128, 3)}
TWO_CTA_HEAD_DIMS = (128, 192, 256)
# Registers per thread after setmaxnreg, per warpgroup: (softmax, correction, MMA + load).
# 384 threads launch at 168 (65536 / 384, in 8-register steps); the raise must be covered by
# what the two others give back: 240 + 160 + 104 = 3 x 168.
REGS = (240, 160, 104)
LAUNCH_REGS = 168


@dataclasses.dataclass(frozen=True)
class Sm100FwdConfig:
    """One compiled variant of `FlashFwdSm100`.

    Features as `FwdConfig` (dtype, head_dim, head_dim_v, is_causal, has_window, has_softcap,
    has_q_seqlen, has_kv_seqlen, has_alibi, has_segments), plus:

    tile_n / num_stages: key tile and K/V pipeline depth (None: the per-head-dim default).
    ex2_poly_every: every this-many-th pair of scores of a row is exponentiated by the
      polynomial on the FMA pipes instead of MUFU.EX2 (`exp2_poly`); 0: all on MUFU.
    rescale_threshold: conditional rescaling (log2 units): a row's reference max moves (and the
      correction warpgroup rescales its O row) only when the block max exceeds it by more than
      this; probabilities then reach at most 2**threshold. FlashAttention-4 uses 8 for 16-bit
      inputs; 0 rescales on any growth.
    two_cta: a cluster of two CTAs (consecutive 128-row tiles of one head) issues each MMA as
      one ``tcgen05.mma.cta_group::2`` of M = 256 (`sm100.fwd_2cta`): each CTA loads half of
      every K and V tile. Dense head dims 128 / 192 / 256 only (no causal, window, query lengths
      or segment ids: both CTAs of a pair must walk the same key blocks).
    """

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int | None = None
    is_causal: bool = False
    has_window: bool = False
    has_softcap: bool = False
    has_q_seqlen: bool = False
    has_kv_seqlen: bool = False
    has_alibi: bool = False
    has_segments: bool = False
    tile_n: int | None = None
    num_stages: int | None = None
    ex2_poly_every: int = 4
    rescale_threshold: float = 8.0
    two_cta: bool = False

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        tiles = _TILES_2CTA if self.two_cta and self.head_dim in _TILES_2CTA else _TILES
        tn, st = tiles.get(self.head_dim, (128, 2))
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", tn)
        if self.num_stages is None:
            object.__setattr__(self, "num_stages", st)
        ok, why = self.check()
        if not ok:
            raise ValueError(f"invalid Sm100FwdConfig {self}: {why}")

    @property
    def tile_m(self) -> int:
        return TILE_M

    def tmem_plan(self) -> tmem_plan.TmemPlan:
        return tmem_plan.forward_plan(self.tile_n, self.head_dim_v)

    def check(self) -> tuple[bool, str]:
        if self.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {self.dtype} not in {SUPPORTED_DTYPES}"
        return self.check_machine()

    def check_machine(self) -> tuple[bool, str]:
        """The rules every element type shares: head dims, tiles, stages, the exp2 share,
        registers, shared memory (`smem_bytes`) and the tensor-memory plan (`tmem_plan`)."""
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        if self.tile_n not in (64, 128):
            return False, f"tile_n {self.tile_n} must be 64 or 128"
        if not 1 <= self.num_stages <= 4:
            return False, f"num_stages {self.num_stages} must be in [1, 4]"
        if self.ex2_poly_every < 0 or self.ex2_poly_every == 1:
            return False, (f"ex2_poly_every {self.ex2_poly_every}: 0 (off) or >= 2 (one pair "
                           "in that many on the FMA pipes)")
        if not 0.0 <= self.rescale_threshold <= 16.0:
            return False, (f"rescale_threshold {self.rescale_threshold} must be in [0, 16] "
                           "(probabilities reach 2**threshold)")
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B "
                           f"(tile 128x{self.tile_n}, {self.num_stages} stages)")
        if self.two_cta and (self.head_dim not in TWO_CTA_HEAD_DIMS or self.is_causal
                             or self.has_window or self.has_q_seqlen or self.has_segments):
            return False, ("two_cta: dense head dims 128 / 192 / 256 only (no causal, window, "
                           "query lengths or segment ids: a CTA pair walks one key range)")
        if sum(REGS) > 3 * LAUNCH_REGS:
            return False, f"register budgets {REGS} exceed 3 x {LAUNCH_REGS}"
        return self.tmem_plan().check()

    def smem_bytes(self) -> int:
        """Per CTA (a 2-CTA pair's CTA holds half of each K and V tile)."""
        q = TILE_M * self.head_dim * 2
        kv = self.num_stages * self.tile_n * (self.head_dim + self.head_dim_v) * 2
        if self.two_cta:
            kv //= 2
        return q + kv + 4096  # + barriers, per-row scales, alignment

    @property
    def key(self) -> str:
        feats = [n for n, on in (("causal", self.is_causal), ("window", self.has_window),
                                 ("softcap", self.has_softcap), ("qlen", self.has_q_seqlen),
                                 ("kvlen", self.has_kv_seqlen), ("alibi", self.has_alibi),
                                 ("seg", self.has_segments)) if on]
        return (f"fwd_sm100_{self.dtype}_h{self.head_dim}_hv{self.head_dim_v}"
                f"_t{TILE_M}x{self.tile_n}s{self.num_stages}_e{self.ex2_poly_every}"
                f"_r{self.rescale_threshold:g}_{'-'.join(feats) or 'dense'}"
                + ("_2cta" if self.two_cta else ""))


def can_implement(config: Sm100FwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the sm_100a forward serves a problem (a config, or keyword facts as
    `variants.fwd.can_implement`)."""
    if config is not None:
        return config.check()
    dtype = problem.get("dtype")
    if dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {dtype} not supported (only {SUPPORTED_DTYPES})"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} not supported by the sm_100a forward (only {SUPPORTED_HEAD_DIMS})"
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    unsupported = [f for f in problem.get("features", ())
                   if f not in ("causal", "window", "softcap", "seq_lengths", "alibi",
                                "segment_ids")]
    if unsupported:
        return False, f"features {unsupported} not supported by the sm_100a forward kernel"
    return True, ""
