"""Tile handoff of the forward kernel's ``tile_pipe`` mode: the producer warp decodes each tile
once and publishes its (m_block, head, batch) to the consumer warpgroups through a 2-slot
shared-memory pipe, so the consumers never run the scheduler's decode themselves.

The slots are 4 Int32 each (m_block, head, batch, unused) in the kernel's shared storage, with
their full/empty barriers beside them; m_block -1 announces that no tile is left.
"""
from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


def make_tile_pipe(barrier_storage, num_consumer_threads: int):
    """The 2-slot pipe (trace time, before the warp roles split): written by one producer
    thread, read (then released) by every consumer thread."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_storage, num_stages=2,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
        defer_sync=True)


@cute.jit
def announce_tile(pipe_tile, sTile: cute.Tensor, state, m_block: Int32, head: Int32,
                  batch: Int32):
    """Producer (warp 0): publish a tile's coordinates in the next slot once the consumers
    have read the slot's previous tile. Returns the advanced state."""
    pipe_tile.producer_acquire(state)
    with cute.arch.elect_one():
        sTile[0, state.index] = m_block
        sTile[1, state.index] = head
        sTile[2, state.index] = batch
        pipe_tile.producer_commit(state)  # release: the stores above are visible after it
    state.advance()
    return state


@cute.jit
def next_tile(pipe_tile, sTile: cute.Tensor, state):
    """Consumers: (m_block, head, batch, advanced state) of the next tile (m_block -1:
    none left)."""
    pipe_tile.consumer_wait(state)
    m_block = sTile[0, state.index]
    head = sTile[1, state.index]
    batch = sTile[2, state.index]
    pipe_tile.consumer_release(state)
    state.advance()
    return m_block, head, batch, state
