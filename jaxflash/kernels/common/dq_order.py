"""The backward's dQ accumulator in global memory: zeroing it (and the ordering semaphores)
before the main kernel, and the deterministic mode's turn-taking, shared by the Blackwell
backward (and the same protocol as the Hopper backward's `sm90.dq_accum`).

Deterministic mode: the reduce-adds into one (batch, head, query block) of the float32 dQ
accumulator happen in key-block order. A semaphore per (batch, head, query block), zeroed
with dQ, counts the key blocks done: the CTA of key block n waits until it equals
n - first (the lowest key block visiting that query block), adds, waits for its adds to
complete and releases n + 1. It only waits on lower key blocks of its (kv head, batch),
which launch before it.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

_ZERO_THREADS = 256
_ZERO_PER_THREAD = 4


@cute.jit
def zero_fill(t: cute.Tensor, stream: cuda.CUstream):
    """Launch `zero_kernel` over a compact tensor (viewed flat) on `stream`. The element count
    and offsets are 64-bit (the dQ accumulator reaches 2^31 elements at long contexts)."""
    total = Int64(1)
    for i in cutlass.range_constexpr(cute.rank(t)):
        total = total * Int64(cute.size(t, mode=[i]))
    per_cta = _ZERO_THREADS * _ZERO_PER_THREAD
    zero_kernel(t.iterator, total).launch(
        grid=[Int32((total + per_cta - 1) // per_cta), 1, 1], block=[_ZERO_THREADS, 1, 1],
        stream=stream)


@cute.kernel
def zero_kernel(base_ptr: cute.Pointer, total: Int64):
    tidx, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    per_cta = _ZERO_THREADS * _ZERO_PER_THREAD
    start = Int64(bid) * per_cta
    chunk = cute.make_tensor(base_ptr + start, cute.make_layout(per_cta))
    for k in cutlass.range_constexpr(_ZERO_PER_THREAD):
        i = tidx + k * _ZERO_THREADS  # consecutive threads, consecutive words
        if start + i < total:
            chunk[i] = chunk.element_type(0)


@cute.jit
def wait_turn(sem, turn: Int32):
    """Warp-wide: return once the semaphore equals `turn` (lane 0 spins on acquire loads),
    with this warp's later TMA (async proxy) operations ordered after that load."""
    if cute.arch.lane_idx() == 0:
        seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
        while seen != turn:
            seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    cute.arch.fence_proxy("async.global")


@cute.jit
def pass_turn(sem):
    """After this warp's reduce-adds: wait for them to complete (writes done, not just the
    shared-memory reads), order them before the release, and hand the query block on."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_proxy("async.global")
    if cute.arch.lane_idx() == 0:
        cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()
