"""Bucketed gradient synchronisation over the data-parallel group, overlapped with backward.

A hook on each parameter counts the gradients that are ready; when every gradient of a bucket has
arrived (on the last micro-batch of an accumulation), the bucket's collective starts asynchronously
while backward goes on with earlier layers. ``finish()`` starts any bucket whose parameters received
no gradient, waits for all, and leaves the data-parallel mean in the gradient buffer.
"""

from __future__ import annotations

import contextlib

from torch import nn

from parallel import comm
from parallel.comm import AxisGroup
from parallel.zero.flat_buffer import Bucket, FlatParameterBuffer


class BucketedAllReduce:
    """Stage-0 gradient sync: all-reduce each full bucket of the flat gradient buffers.

    Owns the per-bucket readiness counts and the in-flight handles. Never changes parameter values
    and never reads gradients outside the buffers it was given.
    """

    def __init__(self, buffers: list[FlatParameterBuffer], dp: AxisGroup):
        self.buffers, self.dp = buffers, dp
        self.enabled = True
        self._bucket_of: dict[nn.Parameter, tuple[FlatParameterBuffer, Bucket]] = {}
        for buffer in buffers:
            for bucket in buffer.buckets:
                for param in bucket.params:
                    self._bucket_of[param] = (buffer, bucket)
        self._ready: dict[tuple[int, int], int] = {}
        self._handles: dict[tuple[int, int], object] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._bucket_of]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches before the last one)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def _key(self, buffer: FlatParameterBuffer, bucket: Bucket) -> tuple[int, int]:
        return self.buffers.index(buffer), bucket.index

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        buffer, bucket = self._bucket_of[param]
        key = self._key(buffer, bucket)
        if key in self._handles:
            raise RuntimeError("a parameter received a second gradient after its bucket was already being "
                               "reduced: run every backward but the last of an accumulation inside "
                               "optimizer.no_sync()")
        self._ready[key] = self._ready.get(key, 0) + 1
        if self._ready[key] == len(bucket.params):
            self._launch(buffer, bucket)

    def _launch(self, buffer: FlatParameterBuffer, bucket: Bucket) -> None:
        grads = buffer.grad[bucket.start:bucket.end]
        grads.div_(self.dp.size)  # gloo has no AVG: pre-divide, then sum
        self._handles[self._key(buffer, bucket)] = comm.all_reduce(grads, self.dp, async_op=True)

    def finish(self) -> None:
        """Complete the sync of every bucket (in bucket order, the same on every rank)."""
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                if self._key(buffer, bucket) not in self._handles:
                    self._launch(buffer, bucket)
        for handle in self._handles.values():
            handle.wait()
        self._handles.clear()
        self._ready.clear()
