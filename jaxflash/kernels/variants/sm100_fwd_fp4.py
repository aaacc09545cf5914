"""Static configuration of the sm_100a FP4 Direct-P forward: `Sm100FwdFp4Config` (DSL-free).

The kernel (`kernels/sm100/fwd_fp4.py`) is the non-causal inference forward of the FP4 paper:
Q, K in NVFP4 (E2M1 payload, E4M3 scale per 16 along the head dim), P and V in MXFP4 (E8M0
scale per 32 keys), P produced straight from the scores by the affine map of
`jaxflash.fp4.constants` (the one module the JAX emulator imports too).

Operands as the kernel reads them (prepared by XLA, see `operand_shapes`):

* q ``uint8 [B, T, N, H/2]``, k ``uint8 [B, S, K, H/2]``: two E2M1 codes a byte, element 0 in
  the low nibble.
* vt ``uint8 [B, K, Hv, S_pad/2]``: V transposed, keys contiguous (the FP4 MMA takes K-major
  operands only), S padded to the key tile.
* sfq / sfk / sfv: the block scales, one 512-byte "atom" per 128 rows x 4 scale blocks in the
  tcgen05 scale-factor order (byte ``16 (r % 32) + 4 (r // 32) + (b % 4)`` of atom ``b // 4``
  for row r, block b; `scale_atom_offset`), chunked per 128-row tile so the load warp copies
  one contiguous chunk per tile.
* qk_scale ``float32 [B, N]``: softmax scale * log2(e) / (G_q G_k) (the NVFP4 global factors
  folded in); with a row reference (accurate policy, guard) ``m_ref float32 [B, N, T]`` in
  logit units.

Compiled and instruction-checked here only: no Blackwell GPU has run it, so dispatch gates it
(`policy.verified`) like every sm_100a variant.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from jaxflash.fp4 import constants as C
from jaxflash.kernels.variants import tmem_plan
from jaxflash.kernels.variants.sm100_fwd import LAUNCH_REGS, REGS, SMEM_LIMIT_BYTES, TILE_M

SUPPORTED_HEAD_DIMS = (64, 128)
TILE_N = C.KEY_TILE                  # keys per S tile: four N32 P blocks, two K64 PV MMAs
SF_ATOM_ROWS = 128                   # one scale-factor atom: 128 rows x 4 blocks = 512 bytes
SF_ATOM_BLOCKS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_BLOCKS
# tensor-memory columns of the P overlay on its S buffer: 128 E2M1 codes a row = 64 bytes =
# 16 columns, then one scale page (one atom: 4 columns) per K64 half of P; each half (its 8
# code columns and its page) is published on its own, so PV's first half starts while the
# softmax works on the second (the paper's "publish after two N32 blocks form a K64 operand")
P_PAYLOAD_COLS = TILE_N * 4 // 32
P_HALVES = 2
P_HALF_COLS = P_PAYLOAD_COLS // P_HALVES
P_PAGE_COLS = 4


def scale_atom_offset(row: int, block: int) -> int:
    """Byte of (row, block) inside a tile's scale chunk (rows < 128): the tcgen05 scale-factor
    atom ((32, 4), 4) : ((16, 4), 1), atoms along the blocks."""
    if not 0 <= row < SF_ATOM_ROWS or block < 0:
        raise ValueError(f"row {row} / block {block} outside a 128-row scale chunk")
    return ((block // SF_ATOM_BLOCKS) * SF_ATOM_BYTES + 16 * (row % 32) + 4 * (row // 32)
            + block % SF_ATOM_BLOCKS)


@dataclasses.dataclass(frozen=True)
class Sm100FwdFp4Config:
    """One compiled variant of `FlashFwdFp4Sm100`.

    policy: a key of `constants.POLICIES` ("fast", "accurate", "wan"); the affine map (A, B),
      the anchor rows and the native-EX2 pair positions come from there.
    guard_shift: the extreme-logit guard's scale shift L (None: no guard); the margin M is in
      the row reference XLA computes (m = anchor max + M ln 2), so it is not compiled in.
    num_stages: K/V pipeline depth.
    """

    head_dim: int = 128
    policy: str = "fast"
    guard_shift: Optional[int] = None
    num_stages: int = 4
    out_dtype: str = "bfloat16"

    def __post_init__(self):
        ok, why = self.check()
        if not ok:
            raise ValueError(f"invalid Sm100FwdFp4Config {self}: {why}")

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    @property
    def tile_m(self) -> int:
        return TILE_M

    @property
    def tile_n(self) -> int:
        return TILE_N

    @property
    def params(self) -> dict:
        return C.POLICIES[self.policy]

    @property
    def has_row_ref(self) -> bool:
        """The row reference m_i comes from XLA (anchor rows or the guard); else m_i = 0."""
        return bool(self.params["anchor_rows"]) or self.guard_shift is not None

    def native_pair(self, pair: int) -> bool:
        """Whether score pair ``pair`` (0..15) of an N32 block takes the native EX2."""
        period = self.params["native_ex2_pair_period"]
        return bool(period) and pair % period == self.params["native_ex2_pair_offset"]

    def sf_cols(self) -> tuple[int, int]:
        """Tensor-memory columns of one (Q or K) scale set and of one V scale set."""
        return self.head_dim // C.QK_BLOCK, TILE_N // C.V_BLOCK

    def tmem_plan(self) -> tmem_plan.TmemPlan:
        """S0 | S1 | O | SFQ | SFK0 | SFK1 | SFV0 | SFV1; P_i over the first 24 columns of S_i
        (codes 0-15, the two halves' scale pages 16-19 and 20-23), written only after the
        softmax has read all of S_i, half by half."""
        n, hv = TILE_N, self.head_dim_v
        qk_cols, v_cols = self.sf_cols()
        regions = [tmem_plan.Region("S0", "S", 0, n, 0), tmem_plan.Region("S1", "S", n, n, 1),
                   tmem_plan.Region("O", "O", 2 * n, hv)]
        col = 2 * n + hv
        for name, cols in (("SFQ", qk_cols), ("SFK0", qk_cols), ("SFK1", qk_cols),
                           ("SFV0", v_cols), ("SFV1", v_cols)):
            regions.append(tmem_plan.Region(name, "SF", col, cols))
            col += cols
        over = P_PAYLOAD_COLS + P_HALVES * P_PAGE_COLS
        regions += [tmem_plan.Region("P0", "P", 0, over, 0),
                    tmem_plan.Region("P1", "P", n, over, 1)]
        order = tuple(("load", c, 32) for c in range(0, n, 32))
        for h in range(P_HALVES):
            order += (("store", h * P_HALF_COLS, P_HALF_COLS),
                      ("store", P_PAYLOAD_COLS + h * P_PAGE_COLS, P_PAGE_COLS))
        return tmem_plan.TmemPlan(tuple(regions), order)

    def tmem_offsets(self) -> dict:
        plan = self.tmem_plan()
        return {r.name: r.start for r in plan.regions}

    def check(self) -> tuple[bool, str]:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if C.P_SCALE_RULE != "ocp":
            return False, (f"the kernel implements the 'ocp' block-exponent rule, constants "
                           f"say {C.P_SCALE_RULE!r}")
        if self.policy not in C.POLICIES:
            return False, f"policy {self.policy!r} not in {sorted(C.POLICIES)}"
        if self.guard_shift is not None:
            try:
                C.check_guard(0, self.guard_shift)
            except ValueError as e:
                return False, str(e)
        if not 1 <= self.num_stages <= 8:
            return False, f"num_stages {self.num_stages} must be in [1, 8]"
        if self.out_dtype != "bfloat16":
            return False, f"out_dtype {self.out_dtype}: only bfloat16"
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B"
        if sum(REGS) > 3 * LAUNCH_REGS:
            return False, f"register budgets {REGS} exceed 3 x {LAUNCH_REGS}"
        return self.tmem_plan().check()

    def sf_bytes(self) -> tuple[int, int, int]:
        """Bytes of one tile's Q, K and V scale chunks (V's Hv rows padded to a whole 128-row
        atom: the scale-factor layouts come in atoms)."""
        qk = TILE_M * self.head_dim // C.QK_BLOCK
        v_rows = -(-self.head_dim_v // SF_ATOM_ROWS) * SF_ATOM_ROWS
        return qk, TILE_N * self.head_dim // C.QK_BLOCK, v_rows * TILE_N // C.V_BLOCK

    def smem_bytes(self) -> int:
        q = TILE_M * self.head_dim // 2
        kv = self.num_stages * TILE_N * (self.head_dim + self.head_dim_v) // 2
        sfq, sfk, sfv = self.sf_bytes()
        pages = 2 * P_HALVES * SF_ATOM_BYTES
        return q + kv + sfq + self.num_stages * (sfk + sfv) + pages + 4096

    def operand_shapes(self, B: int, T: int, S: int, N: int, K: int) -> dict:
        """Shapes (uint8 unless said) of the kernel's operands for a problem."""
        m_tiles, n_tiles = -(-T // TILE_M), -(-S // TILE_N)
        sfq, sfk, sfv = self.sf_bytes()
        h = self.head_dim
        shapes = {"q": (B, T, N, h // 2), "k": (B, S, K, h // 2),
                  "vt": (B, K, self.head_dim_v, n_tiles * TILE_N // 2),
                  "sfq": (B, N, m_tiles, sfq), "sfk": (B, K, n_tiles, sfk),
                  "sfv": (B, K, n_tiles, sfv), "qk_scale": (B, N)}
        if self.has_row_ref:
            shapes["m_ref"] = (B, N, T)
        return shapes

    @property
    def key(self) -> str:
        g = "" if self.guard_shift is None else f"_g{self.guard_shift}"
        return (f"fwd_sm100_fp4_{self.policy}_h{self.head_dim}_t{TILE_M}x{TILE_N}"
                f"s{self.num_stages}{g}")


def can_implement(config: Sm100FwdFp4Config | None = None, **problem) -> tuple[bool, str]:
    """Whether the FP4 Direct-P kernel serves a problem (a config, or keyword facts: head_dim,
    head_dim_v, is_causal, features)."""
    if config is not None:
        return config.check()
    hd = problem.get("head_dim")
    hdv = problem.get("head_dim_v", hd)
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {hd} not supported by the FP4 kernel (only {SUPPORTED_HEAD_DIMS})"
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    if problem.get("is_causal"):
        return False, "the FP4 Direct-P kernel is the non-causal inference forward"
    if problem.get("features"):
        return False, f"features {list(problem['features'])} not supported by the FP4 kernel"
    return True, ""
