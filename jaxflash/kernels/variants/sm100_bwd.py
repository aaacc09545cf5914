"""Static configuration of the Blackwell (sm_100a) backward kernel: `Sm100BwdConfig` (DSL-free).

The feature fields carry the names of the Hopper `BwdConfig`'s, and the launch takes the same
tensors in the same order (q, k, v, do, lse2, delta, [lengths], dq_acc, dk, dv, [dq_sem]), so
the XLA side (`kernels.call`: `bwd_prepare`, the dQ scale and cast) is shared unchanged.

The machine differs: one CTA per (key block of 128 keys, kv head, batch), looping over the
query heads of its GQA group and their 128-query blocks; every accumulator (S^T, dP^T, dV, dK
and the step's dQ) lives in tensor memory (`tmem_plan.backward_plan`); four warpgroups with
their own register budgets (dQ reduce, two compute warpgroups, one holding the MMA and load
warps). Head dim 256 does not fit: dK and dV alone take 2 x 256 = 512 columns, all of tensor
memory, before S^T and dP^T (see `check`).

Compiled and instruction-checked here only: no Blackwell GPU has run it, so dispatch gates it
(`policy.verified`) until one does.
"""
from __future__ import annotations

import dataclasses

from jaxflash.kernels.variants import tmem_plan

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# The passes of a backward: "all" computes dV, dK and dQ in one kernel (hd 64 / 128); at hd 256
# "dv" (dV only) runs first, then "dkdq" (dK and dQ). Each pass recomputes S^T and P^T.
PASSES = {"all": ("all",), "split": ("dv", "dkdq")}
SPLIT_HEAD_DIMS = (256,)
TILE_M_DKDQ = 64  # queries per step of the "dkdq" pass (shared memory: K, V 64 KB each)
SUPPORTED_DTYPES = ("bfloat16", "float16")
SMEM_LIMIT_BYTES = 227 * 1024
TILE_M = 128  # queries per step (the N of the S^T / dP^T MMAs, the M of the dQ MMA)
TILE_N = 128  # keys per CTA (the M of S^T, dP^T, dV, dK: all 128 tensor-memory lanes)
# dQ leaves tensor memory in column chunks of this width: one TMA reduce-add box of
# 128 rows x 32 float32 (128-byte rows) per chunk, two chunk buffers in shared memory.
DQ_CHUNK = 32
# Registers per thread after setmaxnreg, per warpgroup (all warps of a warpgroup must execute
# the same setmaxnreg): (dQ reduce, compute x 2, MMA + load). 512 threads launch at 128
# (65536 / 512); the raises must be covered by what the others give back:
# 80 + 2 x 176 + 80 = 4 x 128.
REGS = (80, 176, 80)
LAUNCH_REGS = 128


def register_total(regs=REGS) -> int:
    """Registers per thread summed over the four warpgroups' budgets (<= 4 x LAUNCH_REGS)."""
    reduce, compute, other = regs
    return reduce + 2 * compute + other


@dataclasses.dataclass(frozen=True)
class Sm100BwdConfig:
    """One compiled variant of `FlashBwdSm100`.

    Features as `BwdConfig` (dtype, head_dim, head_dim_v, is_causal, has_window, has_softcap,
    has_q_seqlen, has_kv_seqlen, deterministic), plus:

    num_stages: pipeline depth of the Q (+ lse2) and dO (+ delta) loads (None: the most, up to
      2, that shared memory holds: 2 at hd 64, 1 at hd 128 and 256).
    bwd_pass: "all" (hd 64 / 128: dV, dK and dQ in one kernel) or, at hd 256, one of the two
      passes: "dv" (S^T, P^T and dV += P^T dO, 128-query steps) and "dkdq" (S^T, dP^T, dS^T,
      dK += dS^T Q and dQ^T = K^T dS^T, 64-query steps). `passes` gives the configs a
      backward runs, in order.

    has_alibi: slopes [1, N]; the bias -slope |i - j| enters S^T before the masks, and the
    kernel writes per-compute-warp partial sums of dS_ij |i - j| (``ALIBI_PARTS`` = its 8
    compute warps, per (batch, head, key block)) that the shared XLA side reduces into
    d(slopes), as for Hopper.
    has_segments: q / kv segment ids and their block summaries with rows = keys (the Hopper
    backward's inputs): a CTA visits only the query blocks whose ids can meet its keys, and
    block pairs not inside one segment get the element compare.
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
    deterministic: bool = False
    num_stages: int | None = None
    bwd_pass: str | None = None

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.bwd_pass is None:
            object.__setattr__(self, "bwd_pass",
                               "dv" if self.head_dim in SPLIT_HEAD_DIMS else "all")
        if self.num_stages is None:
            object.__setattr__(self, "num_stages", 2)
            if self.smem_bytes() > SMEM_LIMIT_BYTES:
                object.__setattr__(self, "num_stages", 1)
        ok, why = self.check()
        if not ok:
            raise ValueError(f"invalid Sm100BwdConfig {self}: {why}")

    # what the shared XLA side (`kernels.call._backward`) reads of a backward config
    tile_n = TILE_N
    dq_flat = False
    score_mod = ""
    mask_mod = ""
    aux = ()

    @property
    def tile_m(self) -> int:
        return TILE_M_DKDQ if self.bwd_pass == "dkdq" else TILE_M

    @property
    def has_dv(self) -> bool:
        return self.bwd_pass in ("all", "dv")

    @property
    def has_dkdq(self) -> bool:
        return self.bwd_pass in ("all", "dkdq")

    def passes(self) -> tuple["Sm100BwdConfig", ...]:
        """The configs a backward with this config runs, in order (one, or "dv" then "dkdq")."""
        if self.bwd_pass == "all":
            return (self,)
        return tuple(dataclasses.replace(self, bwd_pass=p, num_stages=None)
                     for p in PASSES["split"])

    def tmem_plan(self) -> tmem_plan.BwdTmemPlan:
        return tmem_plan.backward_plan(self.tile_m, self.head_dim, self.head_dim_v,
                                       bwd_pass=self.bwd_pass)

    def check(self) -> tuple[bool, str]:
        if self.dtype not in SUPPORTED_DTYPES:
            return False, f"dtype {self.dtype} not in {SUPPORTED_DTYPES}"
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        split = self.head_dim in SPLIT_HEAD_DIMS
        if self.bwd_pass not in (PASSES["split"] if split else PASSES["all"]):
            return False, (f"bwd_pass {self.bwd_pass!r} at head_dim {self.head_dim}: "
                           + ("dK and dV accumulators alone need 2 x 256 = 512 tensor-memory "
                              "columns, so hd 256 runs as the passes 'dv' and 'dkdq'" if split
                              else "hd 64 / 128 run in one pass, 'all'"))
        if self.head_dim_v != self.head_dim:
            return False, f"head_dim_v {self.head_dim_v} != head_dim {self.head_dim}"
        if self.has_segments and self.deterministic:
            return False, ("deterministic with segment ids: the key-block order of the dQ adds "
                           "assumes the geometric block ranges, which segment skipping changes")
        if self.has_alibi and self.has_softcap:
            return False, ("ALiBi with softcap: as the Hopper backward, not implemented (the "
                           "softcap derivative needs tanh of the score without the bias)")
        if not 1 <= self.num_stages <= 2:
            return False, f"num_stages {self.num_stages} must be 1 or 2"
        if self.smem_bytes() > SMEM_LIMIT_BYTES:
            return False, (f"shared memory {self.smem_bytes()} B exceeds {SMEM_LIMIT_BYTES} B "
                           f"(head_dim {self.head_dim}, {self.num_stages} stages)")
        if register_total() > 4 * LAUNCH_REGS:
            return False, f"register budgets {REGS} exceed 4 warpgroups x {LAUNCH_REGS}"
        return self.tmem_plan().check()

    def smem_bytes(self) -> int:
        elt, m = 2, self.tile_m
        if self.bwd_pass == "dv":  # K; Q (+ lse2) and dO per stage: no V, dS, delta or dQ
            return (TILE_N * self.head_dim * elt
                    + self.num_stages * m * ((self.head_dim + self.head_dim_v) * elt + 4)
                    + 2048)
        kv = TILE_N * (self.head_dim + self.head_dim_v) * elt
        qdo = self.num_stages * m * (self.head_dim + self.head_dim_v) * elt
        ds = TILE_N * m * elt
        rows = 2 * self.num_stages * m * 4  # lse2 / delta per stage
        dq = 2 * m * DQ_CHUNK * 4  # "dkdq": one 32 x 32 box per reduce warp, the same bytes
        return kv + qdo + ds + rows + dq + 2048  # + barriers and alignment

    @property
    def key(self) -> str:
        feats = [n for n, on in (("causal", self.is_causal), ("window", self.has_window),
                                 ("softcap", self.has_softcap), ("qlen", self.has_q_seqlen),
                                 ("kvlen", self.has_kv_seqlen), ("alibi", self.has_alibi),
                                 ("seg", self.has_segments), ("det", self.deterministic))
                 if on]
        part = "" if self.bwd_pass == "all" else f"_{self.bwd_pass}"
        return (f"bwd_sm100_{self.dtype}_h{self.head_dim}_hv{self.head_dim_v}"
                f"_t{self.tile_m}x{TILE_N}s{self.num_stages}{part}_"
                f"{'-'.join(feats) or 'dense'}")


FEATURES = ("causal", "window", "softcap", "seq_lengths", "alibi", "segment_ids")


def can_implement(config: Sm100BwdConfig | None = None, **problem) -> tuple[bool, str]:
    """Whether the sm_100a backward serves a problem (a config, or keyword facts as
    `variants.sm100_fwd.can_implement`)."""
    if config is not None:
        return config.check()
    dtype = problem.get("dtype")
    if dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {dtype} not supported (only {SUPPORTED_DTYPES})"
    hd, hdv = problem.get("head_dim"), problem.get("head_dim_v", problem.get("head_dim"))
    if hd not in SUPPORTED_HEAD_DIMS:
        return False, (f"head dim {hd} not supported by the sm_100a backward (only "
                       f"{SUPPORTED_HEAD_DIMS})")
    if hdv != hd:
        return False, f"value head dim {hdv} != head dim {hd} not supported"
    feats = tuple(problem.get("features", ()))
    unsupported = [f for f in feats if f not in FEATURES]
    if unsupported:
        return False, f"features {unsupported} not supported by the sm_100a backward kernel"
    if "alibi" in feats and "softcap" in feats:
        return False, "ALiBi with softcap not supported by the sm_100a backward kernel"
    return True, ""
