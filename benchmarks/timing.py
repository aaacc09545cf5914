"""Timing of jitted JAX calls.

Throughput (`time_throughput`): after compile and warm-up, one rep dispatches `n` calls back to
back and blocks once at the end; the time per call is the rep's wall time / n; the figure is the
median over `reps` reps, with min and max kept as the spread. Why this and not CUDA events:
JAX gives no public handle on the stream XLA launches on, so events would time a different
stream; the host clock around a synchronized loop measures the same thing for every
implementation alike (XLA fusions, cuDNN, Triton, FFI custom calls), needs nothing but JAX, and
works on CPU. JAX dispatch is asynchronous, so while each call's device time (>= 0.1 ms on the
grid) exceeds its host dispatch cost (~10-30 us), the device queue never drains and the loop
measures device time; the one synchronization per rep is amortized over n calls, and `n` is
chosen so that one rep lasts at least `min_rep_s`. The median discards the reps that another
tenant of the machine disturbed.

Latency (`time_latency`): the opposite question, what one small call costs the caller: each call
timed alone, dispatch and synchronization included, median of many.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    n: int  # calls per rep
    reps: int


def time_throughput(fn, args, *, reps=7, min_rep_s=0.025, max_n=200, warmup=1) -> Timing:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    est = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max_n, max(1, math.ceil(min_rep_s / est))))
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / n)
    return Timing(statistics.median(per_call), min(per_call), max(per_call), n, reps)


def time_latency(fn, args, *, calls=200, warmup=20) -> Timing:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return Timing(statistics.median(ts), min(ts), max(ts), 1, calls)
