"""Gradients reduce-scattered through staging slots, each rank's part added into its gradient shard.

Stage 2 (per bucket) and stage 3 (per unit) both reduce every micro-batch's gradients this way: copy
them into a slot of the buffer pool (so the full gradients can be freed at once), divide by the
data-parallel size (gloo has no average), reduce-scatter asynchronously while backward goes on, and add
the received chunk into the shard when the slot is needed again or backward ends. At most one
reduction per key is in flight, and two slots per dtype alternate.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from parallel import comm
from parallel.buffers import BufferPool, StagingRing
from parallel.comm import AxisGroup


class StagedReduceScatter:
    """Owns the staging slots of one gradient dtype and the reductions in flight through them. Never
    keeps a gradient beyond its reduction and never writes a shard before its reduction completed."""

    def __init__(self, pool: BufferPool, name: str, largest: int, dtype: torch.dtype, dp: AxisGroup):
        self.dp = dp
        self._ring = StagingRing(pool, name, largest, dtype)
        self._in_flight: dict[Hashable, tuple[object, torch.Tensor, Callable[[], torch.Tensor]]] = {}

    def launch(self, key: Hashable, numel: int, chunk: int, fill: Callable[[torch.Tensor], None],
               shard: Callable[[], torch.Tensor]) -> None:
        """Reduce ``numel`` elements that ``fill(staging)`` writes (every element: gaps as zeros); this rank's
        ``chunk`` of the sum is added into ``shard()`` when the reduction completes."""
        self.complete(key)
        area = self._ring.take(numel + chunk, lambda: self.complete(key))
        staging, received = area[:numel], area[numel:numel + chunk]
        fill(staging)
        staging.div_(self.dp.size)
        handle = comm.reduce_scatter_tensor(received, staging, self.dp, async_op=True)
        self._in_flight[key] = (handle, received, shard)

    def complete(self, key: Hashable) -> None:
        if key in self._in_flight:
            handle, received, shard = self._in_flight.pop(key)
            handle.wait()
            shard().add_(received)

    def finish(self) -> None:
        """Complete every reduction in flight (launch order) and free the slots."""
        for key in list(self._in_flight):
            self.complete(key)
        self._ring.drain()
