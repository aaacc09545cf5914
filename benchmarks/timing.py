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

Interleaved (`time_interleaved`): the throughput timing of several calls on the same inputs, their
reps taken in turn (A, B, C, A, B, C, ...), so a clock or power drift over the run lands on
every call alike instead of on whichever was timed last: the form for A/B comparisons of
variants, where a few percent decide.

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
    n = _calls_per_rep(fn, args, min_rep_s, max_n, warmup)
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / n)
    return Timing(statistics.median(per_call), min(per_call), max(per_call), n, reps)


def _calls_per_rep(fn, args, min_rep_s, max_n, warmup) -> int:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    est = max(time.perf_counter() - t0, 1e-6)
    return int(min(max_n, max(1, math.ceil(min_rep_s / est))))


def time_interleaved(fns: dict, args, *, reps=7, min_rep_s=0.025, max_n=200,
                     warmup=1) -> dict:
    """`time_throughput` of each of `fns` (name -> jitted callable), the reps taken in turn."""
    ns = {k: _calls_per_rep(f, args, min_rep_s, max_n, warmup) for k, f in fns.items()}
    per_call = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(ns[k]):
                out = f(*args)
            jax.block_until_ready(out)
            per_call[k].append((time.perf_counter() - t0) / ns[k])
    return {k: Timing(statistics.median(v), min(v), max(v), ns[k], reps)
            for k, v in per_call.items()}


def time_latency(fn, args, *, calls=200, warmup=20) -> Timing:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return Timing(statistics.median(ts), min(ts), max(ts), 1, calls)
