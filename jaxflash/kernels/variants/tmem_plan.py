"""Tensor-memory plans of the sm_100a kernels, checked in Python before anything is traced.

Blackwell's tensor memory (TMEM) is 128 lanes x 512 columns of 32 bits per SM; tcgen05 MMAs
write their accumulators there and may read their A operand from it. The forward keeps two score
buffers S0 / S1 (float32, one column per key: the QK MMA of block j + 1 fills one while the
softmax reads the other), the output accumulator O (one column per value dim) and, over each
S buffer, the 16-bit probabilities P the PV MMA reads (two per column: tile_n / 2 columns).

P may only overlay columns of its own S buffer that the softmax has already read into registers
("retired"): the other S buffer may be being written by the next QK MMA, and O is live across
the whole key loop. `TmemPlan.check` proves that from the regions and the softmax's access
order, and every config builds its plan in ``__post_init__``, so a bad plan never compiles.
"""
from __future__ import annotations

import dataclasses

TMEM_COLUMNS = 512
LANES = 128


@dataclasses.dataclass(frozen=True)
class Region:
    """Columns [start, start + cols) of all 128 lanes. kind: "S" (float32 scores), "O" (float32
    output accumulator) or "P" (16-bit probabilities overlaying S buffer ``buffer``)."""

    name: str
    kind: str
    start: int
    cols: int
    buffer: int = 0

    @property
    def end(self) -> int:
        return self.start + self.cols

    def overlaps(self, other: "Region") -> bool:
        return self.start < other.end and other.start < self.end


@dataclasses.dataclass(frozen=True)
class TmemPlan:
    """Regions plus the softmax's order of work on one S buffer: ``softmax_order`` is a tuple of
    ("load", first_col, cols) / ("store", first_col, cols) steps relative to the buffer's first
    column (tcgen05.ld of scores, tcgen05.st of probabilities)."""

    regions: tuple[Region, ...]
    softmax_order: tuple[tuple[str, int, int], ...]
    alloc_cols: int = TMEM_COLUMNS

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def check(self) -> tuple[bool, str]:
        a = self.alloc_cols
        if a < 32 or a > TMEM_COLUMNS or a & (a - 1):
            return False, f"allocation of {a} columns: a power of two in [32, {TMEM_COLUMNS}]"
        for r in self.regions:
            if r.start < 0 or r.cols <= 0 or r.end > a:
                return False, (f"{r.name} [{r.start}, {r.end}) lies outside the {a} allocated "
                               "columns")
        live = [r for r in self.regions if r.kind != "P"]
        for i, r in enumerate(live):
            for q in live[i + 1:]:
                if r.overlaps(q):
                    return False, f"{r.name} and {q.name} overlap"
        for p in (r for r in self.regions if r.kind == "P"):
            s = [r for r in live if r.kind == "S" and r.buffer == p.buffer]
            if len(s) != 1:
                return False, f"{p.name} overlays S buffer {p.buffer}, which does not exist"
            s = s[0]
            for q in live:
                if q is not s and p.overlaps(q):
                    return False, f"{p.name} overlaps live {q.name}"
            if p.start < s.start or p.end > s.end:
                return False, f"{p.name} reaches outside {s.name}"
            ok, why = self._retired_before_store(p, s)
            if not ok:
                return False, why
        return True, ""

    def _retired_before_store(self, p: Region, s: Region) -> tuple[bool, str]:
        """Every column a P store writes was read by an earlier load of the same buffer."""
        read: set[int] = set()
        for op, first, cols in self.softmax_order:
            cols_abs = range(s.start + first, s.start + first + cols)
            if op == "load":
                read.update(cols_abs)
            elif op == "store":
                hit = [c for c in cols_abs if c not in read]
                if hit:
                    return False, (f"{p.name} store to columns [{cols_abs.start}, "
                                   f"{cols_abs.stop}) overwrites scores not read yet "
                                   f"(first: {hit[0]})")
                if cols_abs.start < p.start or cols_abs.stop > p.end:
                    return False, f"a P store [{cols_abs.start}, {cols_abs.stop}) leaves {p.name}"
            else:
                return False, f"unknown softmax step {op!r}"
        return True, ""

    def describe(self) -> str:
        return ", ".join(f"{r.name}[{r.start}:{r.end})" for r in self.regions)


def forward_plan(tile_n: int, head_dim_v: int, load_cols: int = 32,
                 p_offset: int | None = None) -> TmemPlan:
    """The forward's plan: S0 | S1 | O, P_i over S_i at ``p_offset`` (default: the buffer's
    first column). The softmax loads the whole S row in ``load_cols``-column steps, then stores
    P (tile_n / 2 columns) in 32-column steps."""
    p_cols = tile_n // 2
    p_off = 0 if p_offset is None else p_offset
    s0 = Region("S0", "S", 0, tile_n, 0)
    s1 = Region("S1", "S", tile_n, tile_n, 1)
    o = Region("O", "O", 2 * tile_n, head_dim_v)
    regions = (s0, s1, o, Region("P0", "P", p_off, p_cols, 0),
               Region("P1", "P", tile_n + p_off, p_cols, 1))
    order = tuple(("load", c, min(load_cols, tile_n - c)) for c in range(0, tile_n, load_cols))
    order += tuple(("store", p_off + c, min(32, p_cols - c)) for c in range(0, p_cols, 32))
    return TmemPlan(regions, order)


# -- the backward's plan ------------------------------------------------------------------------
# Accumulators with the keys on the 128 lanes: S^T and dP^T (tile_m query columns each), dV and
# dK (one column per head dim, live across the whole query loop). Each compute warpgroup w
# reads its half of the query columns of S^T / dP^T and writes its P^T / dS^T (16-bit, two per
# column) over the first half of the columns *it* read: the other warpgroup's columns may not
# have been read yet. dQ (queries on the lanes) gets its own columns when they fit, else it
# overlays dP^T: the dK MMA that reads dS^T from there is issued before the dQ MMA by the same
# thread (tcgen05 MMAs run in issue order), and the compute warpgroups finished reading dP^T
# before publishing dS^T; the next step's dP^T MMA waits until dQ has been read out.


@dataclasses.dataclass(frozen=True)
class BwdTmemPlan:
    """Regions (kinds: "acc" live accumulators, "S" retiring score buffers S^T / dP^T, "P"
    16-bit overlays of buffer ``buffer``, "dQ" the dQ tile) and each compute warpgroup's order
    of work on a retiring buffer: ``order[(buffer, wg)]`` = (("load" | "store", first, cols),
    ...) relative to the buffer's first column."""

    regions: tuple[Region, ...]
    order: tuple[tuple[tuple[int, int], tuple[tuple[str, int, int], ...]], ...]
    alloc_cols: int = TMEM_COLUMNS

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def check(self) -> tuple[bool, str]:
        a = self.alloc_cols
        if a < 32 or a > TMEM_COLUMNS or a & (a - 1):
            return False, f"allocation of {a} columns: a power of two in [32, {TMEM_COLUMNS}]"
        for r in self.regions:
            if r.start < 0 or r.cols <= 0 or r.end > a:
                return False, (f"{r.name} [{r.start}, {r.end}) lies outside the {a} allocated "
                               "columns")
        live = [r for r in self.regions if r.kind in ("acc", "S")]
        for i, r in enumerate(live):
            for q in live[i + 1:]:
                if r.overlaps(q):
                    return False, f"{r.name} and {q.name} overlap"
        for q in (r for r in self.regions if r.kind == "dQ"):
            for r in live:
                if q.overlaps(r) and r.kind == "acc":
                    return False, (f"{q.name} overlaps {r.name}, an accumulator live across "
                                   "the query loop")
        for p in (r for r in self.regions if r.kind == "P"):
            hosts = [r for r in live if r.kind == "S" and r.buffer == p.buffer]
            if len(hosts) != 1:
                return False, f"{p.name} overlays buffer {p.buffer}, which does not exist"
            s = hosts[0]
            for q in live:
                if q is not s and p.overlaps(q):
                    return False, f"{p.name} overlaps live {q.name}"
            if p.start < s.start or p.end > s.end:
                return False, f"{p.name} reaches outside {s.name}"
        for (buf, wg), steps in self.order:
            s = [r for r in live if r.kind == "S" and r.buffer == buf][0]
            others = set()
            for (b2, w2), st2 in self.order:
                if b2 == buf and w2 != wg:
                    for op, first, cols in st2:
                        if op == "load":
                            others.update(range(s.start + first, s.start + first + cols))
            read: set[int] = set()
            for op, first, cols in steps:
                cs = range(s.start + first, s.start + first + cols)
                if op == "load":
                    read.update(cs)
                    continue
                unread = [c for c in cs if c not in read]
                if unread:
                    return False, (f"warpgroup {wg} stores into {s.name} columns [{cs.start}, "
                                   f"{cs.stop}) before reading them (first: {unread[0]})")
                theirs = [c for c in cs if c in others]
                if theirs:
                    return False, (f"warpgroup {wg} stores into {s.name} columns another "
                                   f"warpgroup reads (first: {theirs[0]})")
                if not any(r.kind == "P" and r.buffer == buf and r.start <= cs.start
                           and cs.stop <= r.end for r in self.regions):
                    return False, f"a store [{cs.start}, {cs.stop}) lies in no overlay of {s.name}"
        return True, ""

    def describe(self) -> str:
        return ", ".join(f"{r.name}[{r.start}:{r.end})" for r in self.regions)


def backward_plan(tile_m: int, head_dim: int, head_dim_v: int, num_wg: int = 2,
                  p_offset: int = 0, dq_start: int | None = None,
                  bwd_pass: str = "all") -> BwdTmemPlan:
    """The backward's plan: S^T | dP^T | dV | dK (| dQ when it fits, else dQ over dP^T). Each
    of the ``num_wg`` compute warpgroups loads its tile_m / num_wg columns of a buffer in
    32-column steps, then stores its 16-bit values (half as many columns) at ``p_offset``
    inside its own columns. ``dq_start`` overrides where dQ goes (tests).

    The passes of a split backward (hd 256, `variants.sm100_bwd.PASSES`) hold only what they
    compute: "dv" is S^T | dV with P^T over S^T (no dP^T, dK or dQ); "dkdq" is S^T | dP^T | dK
    | dQ^T with dS^T over dP^T and no P^T in tensor memory (no dV MMA reads it): dQ^T = K^T
    dS^T has the head dims on the lanes, head_dim / 128 MMAs of tile_m columns each."""
    part = tile_m // num_wg
    s = Region("S^T", "S", 0, tile_m, 0)
    regions = [s]
    overlays = []
    if bwd_pass == "dv":
        regions.append(Region("dV", "acc", s.end, head_dim_v))
        overlays.append((0, s, "P^T"))
    else:
        dp = Region("dP^T", "S", tile_m, tile_m, 1)
        regions.append(dp)
        if bwd_pass == "all":
            dv = Region("dV", "acc", 2 * tile_m, head_dim_v)
            regions.append(dv)
            overlays.append((0, s, "P^T"))
        dk = Region("dK", "acc", regions[-1].end, head_dim)
        regions.append(dk)
        dq_cols = head_dim if bwd_pass == "all" else head_dim // LANES * tile_m
        if dq_start is None:
            dq_start = dk.end if dk.end + dq_cols <= TMEM_COLUMNS else dp.start
        regions.append(Region("dQ", "dQ", dq_start, dq_cols))
        overlays.append((1, dp, "dS^T"))
    order = []
    for buf, host, name in overlays:
        for w in range(num_wg):
            regions.append(Region(f"{name}{w}", "P", host.start + w * part + p_offset,
                                  part // 2, buf))
            steps = tuple(("load", w * part + c, min(32, part - c)) for c in range(0, part, 32))
            steps += tuple(("store", w * part + p_offset + c, min(32, part // 2 - c))
                           for c in range(0, part // 2, 32))
            order.append(((buf, w), steps))
    end = max(r.end for r in regions)
    alloc = 32
    while alloc < end:
        alloc *= 2
    return BwdTmemPlan(tuple(regions), tuple(order), alloc)
