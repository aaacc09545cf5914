"""The TMA producer -> warpgroup consumer pipelines both Hopper kernels build (forward: Q, K, V;
backward: K/V, Q, dO): one producing thread (the TMA warp's elected lane) arrives with the
transaction bytes, every consumer warp releases the slot."""
from __future__ import annotations

import cutlass.pipeline as pipeline


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
