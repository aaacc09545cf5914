"""The TMA producer -> warpgroup consumer pipelines both Hopper kernels build (forward: Q, K, V;
backward: K/V, Q, dO): one producing thread (the TMA warp's elected lane) arrives with the
transaction bytes, every consumer warp releases the slot."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


class TmaPipelines:
    """Factory for the kernel's `PipelineTmaAsync`s, all with the same producer and consumers.

    Created inside the kernel (trace time); `init_done()` once every pipeline is made, before
    the warp roles split (the barriers' init must be visible to all threads)."""

    def __init__(self, num_consumer_threads: int):
        self.producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        self.consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                   num_consumer_threads // 32)

    def make(self, barrier_storage, num_stages: int, tx_count: int):
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_storage, num_stages=num_stages,
            producer_group=self.producer, consumer_group=self.consumers, tx_count=tx_count,
            defer_sync=True)

    @staticmethod
    def init_done():
        pipeline.pipeline_init_arrive()


@cute.jit
def pass_through(pipe_a, pipe_b, state, count: Int32):
    """A consumer with no work in `count` stages of two pipelines that share one state (the
    forward's K and V): wait for each stage to fill, then release it, so the producer's empty
    barriers still count this consumer's warps. Waiting before releasing keeps each arrival in
    its own round's phase. Returns the advanced state."""
    for _ in cutlass.range(count, unroll=1):
        pipe_a.consumer_wait(state)
        pipe_a.consumer_release(state)
        pipe_b.consumer_wait(state)
        pipe_b.consumer_release(state)
        state.advance()
    return state
