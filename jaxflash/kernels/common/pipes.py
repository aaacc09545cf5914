"""The TMA producer -> warpgroup consumer pipelines both Hopper kernels build (forward: Q, K, V;
backward: K/V, Q, dO): one producing thread (the TMA warp's elected lane) arrives with the
transaction bytes, every consumer warp releases the slot."""
from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline


class TmaPipelines:
    """Factory for the kernel's `PipelineTmaAsync`s, all with the same producer and consumers.

    Created inside the kernel (trace time); `init_done()` once every pipeline is made, before
    the warp roles split (the barriers' init must be visible to all threads)."""

    def __init__(self, num_consumer_threads: int):
        self.producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        self.consumer_warps = num_consumer_threads // 32
        self.consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps)

    def make(self, barrier_storage, num_stages: int, tx_count: int, cluster=None):
        """``cluster``: a static (v, m, n, k) layout of the CTAs whose consumers read each
        stage (TMA multicast, `q_multicast`): every consumer warp then releases the stage in
        each of them (lane i signals CTA i), so the EMPTY barrier counts warps x CTAs."""
        consumers, kw = self.consumers, {}
        if cluster is not None:
            consumers = pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.consumer_warps * cute.size(cluster))
            kw = {"cta_layout_vmnk": cluster}
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_storage, num_stages=num_stages,
            producer_group=self.producer, consumer_group=consumers, tx_count=tx_count,
            defer_sync=True, **kw)

    @staticmethod
    def init_done(cluster_shape=None):
        """``cluster_shape``: the launch's cluster (mn layout), None without one; with one,
        a relaxed cluster arrive (the matching wait is `pipeline_init_wait(cluster_shape)`)."""
        pipeline.pipeline_init_arrive(cluster_shape, is_relaxed=cluster_shape is not None)
