"""The benchmark grid (the anchors' grid: fixed total tokens B*S and hidden size N*D) and the
FLOP count every TFLOP/s figure uses."""
from __future__ import annotations

import dataclasses

# The anchor grid of ../shared/anchors/: B*S = 16384 tokens, N*D = 2048 hidden, bf16.
FULL_TOKENS = 16384
FULL_HIDDEN = 2048
FULL_D = (64, 128, 256)
FULL_S = (1024, 4096, 16384)

# The latency point: one tiny call whose cost is dispatch, launch and synchronization.
LATENCY = dict(B=1, N=1, S=128, D=64)

MODES = ("fwd", "fwdbwd")


@dataclasses.dataclass(frozen=True)
class Point:
    """One attention problem: q, k, v all [B, S, N, D] (T = S, MHA)."""

    B: int
    S: int
    N: int
    D: int
    causal: bool

    @property
    def key(self):
        return (self.D, self.S, int(self.causal))

    def label(self):
        s = f"{self.S // 1024}k" if self.S >= 1024 and self.S % 1024 == 0 else str(self.S)
        return f"D{self.D} S{s}{' causal' if self.causal else ''}"


def points(ds, ss, causals, tokens, hidden):
    """The grid in (D, S, causal) order. B = tokens // S and N = hidden // D, at least 1 each."""
    out = []
    for d in ds:
        for s in ss:
            for c in causals:
                out.append(Point(B=max(1, tokens // s), S=s, N=max(1, hidden // d), D=d,
                                 causal=bool(c)))
    return out


def flops(p: Point, mode: str) -> float:
    """4*B*N*S^2*D for the forward (two matmuls of 2*S*S*D each per head), halved when causal;
    forward+backward counts 3.5x the forward (the backward's five matmuls = 2.5x), as FA and the
    anchors do."""
    f = 4.0 * p.B * p.N * p.S * p.S * p.D
    if p.causal:
        f /= 2
    if mode == "fwdbwd":
        f *= 3.5
    elif mode != "fwd":
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    return f
