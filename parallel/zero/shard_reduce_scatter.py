"""Gradients reduce-scattered through staging slots, each rank's part added into its gradient shard.

Stage 2 (per bucket) and stage 3 (per unit) both reduce every micro-batch's gradients this way: copy
them into a slot of the buffer pool (so each full gradient is freed as soon as it is copied), divide by
the data-parallel size (gloo has no average), add the shard's value so far into this rank's own chunk
of the staging, and reduce-scatter asynchronously, straight into the shard, while backward goes on
(the sum over ranks then holds the earlier micro-batches once; on gloo the exchange receives into a
buffer of its own, freed as it completes). A slot is ``open``ed for a key, filled piece by piece as
gradients arrive, then ``start``ed; ``launch`` does all three at once. With ``quantized_levels``
(ZeRO++'s qgZ) the reduction is instead the hierarchical all-to-all of int8 gradients
(``parallel.quantization.quantized_reduce_scatter_add``), whose sum is added into the shard after it
arrives (the shard itself is never quantized); each reduction's next level (the cross-node one) starts
as the next reduction starts, on every rank alike, not inside ``wait``.
At most one reduction per key is in flight, and two slots per dtype alternate (a key that finds both
slots still open gets an area of its own).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable

import torch

from parallel import comm
from parallel.buffer_pool import BufferPool, StagingRing
from parallel.comm import AxisGroup
from parallel.quantization import hierarchy_rank, quantized_reduce_scatter_add


class ShardReduceScatter:
    """Owns the staging slots of one gradient dtype and the reductions in flight through them. Never
    keeps a gradient beyond its reduction and never writes a shard before its reduction completed."""

    def __init__(self, pool: BufferPool, name: str, largest: int, dtype: torch.dtype, dp: AxisGroup,
                 quantized_levels: list[AxisGroup] | None = None, divisor: int | None = None):
        self.dp, self.levels = dp, quantized_levels
        self.divisor = dp.size if divisor is None else divisor
        if quantized_levels is not None and (math.prod(level.size for level in quantized_levels) != dp.size
                                             or hierarchy_rank(quantized_levels) != dp.rank):
            raise ValueError("the quantized gradient levels "
                             f"({' x '.join(level.axis for level in quantized_levels)}) "
                             f"do not make up the {dp.axis} group of {dp.size} in its order")
        # an arena per group: the dense and the expert optimizers reduce at once
        self._ring = StagingRing(pool, f"{name}-{dp.axis}", largest, dtype)
        self._in_flight: dict[Hashable, object] = {}
        self._open: dict[Hashable, tuple] = {}  # key -> (staging, slot or None, shard)

    def open(self, key: Hashable, numel: int, shard: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The ``numel`` staging elements of ``key``, to be filled (every element: gaps as zeros) before
        ``start``; this rank's chunk of the sum is added into ``shard()`` (``numel`` / dp size elements)."""
        self.complete(key)
        held = {slot for _, slot, _ in self._open.values() if slot is not None}
        taken = self._ring.take(numel, lambda: self.complete(key), avoid=held)
        staging, slot = taken if taken is not None else \
            (torch.empty(numel, dtype=self._ring.dtype, device=self._ring.pool.device), None)
        self._open[key] = (staging, slot, shard)
        return staging

    def start(self, key: Hashable) -> None:
        """Reduce-scatter the filled staging of ``key`` asynchronously."""
        staging, _, shard = self._open.pop(key)
        if self.divisor > 1:
            staging.div_(self.divisor)
        into = shard()
        if self.levels is not None:
            # the earlier ones' next levels run behind what follows
            for reduction in self._in_flight.values():
                reduction.advance()
            self._in_flight[key] = quantized_reduce_scatter_add(into, staging, self.levels, async_op=True)
            return
        staging.view(self.dp.size, -1)[self.dp.rank].add_(into)
        self._in_flight[key] = comm.reduce_scatter_tensor(into, staging, self.dp, async_op=True)

    def launch(self, key: Hashable, numel: int, fill: Callable[[torch.Tensor], None],
               shard: Callable[[], torch.Tensor]) -> None:
        """``open``, ``fill(staging)`` and ``start`` in one."""
        fill(self.open(key, numel, shard))
        self.start(key)

    def complete(self, key: Hashable) -> None:
        if key in self._in_flight:
            self._in_flight.pop(key).wait()

    def finish(self) -> None:
        """Complete every reduction in flight (launch order) and free the slots (none may be open)."""
        if self._open:
            raise RuntimeError(f"staging of {sorted(map(str, self._open))} opened but never started")
        for key in list(self._in_flight):
            self.complete(key)
        self._ring.drain()
