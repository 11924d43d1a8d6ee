"""ZeRO stages 0-2 (and stage 3's whole-kept parameters): parameters in flat buffers, kept whole on every
rank; gradients reduced per bucket (all-reduced at stage 0, reduce-scattered at 1, reduce-scattered into
gradient shards every micro-batch at 2); after the step each rank's updated chunks are all-gathered.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.buffer_pool import BufferPool
from parallel.comm import AxisGroup
from parallel.quantization import weight_all_gather
from parallel.zero.flat_parameter_buffer import FlatParameterBuffer
from parallel.zero.grad_sync import (GradientSync, ModelParallelGroups, needs_model_parallel_reduction,
                                     bucket_size_for)
from parallel.zero.masters import MasterShards


class ReplicatedParameters:
    """Owns the flat buffers (parameters become views into them), their gradient sync and the post-step
    all-gathers (left in flight behind the next forward with ``overlap``; with ``quantized_weights`` sent
    as block-wise int8, ``parallel.quantization``; stages 2-3 reduce the gradients as int8 with
    ``quantized_gradients``). Never steps and never holds a master: it hands each
    bucket chunk to ``MasterShards`` as a slot. ``part``: which part of the model (a pipeline chunk)
    a parameter's backward belongs to; buckets never span two.
    """

    def __init__(self, groups: list[list[nn.Parameter]], stage: int, dp: AxisGroup, bucket_size: int,
                 device: torch.device, grad_dtype, model_parallel: ModelParallelGroups, pool: BufferPool,
                 quantized_weights: bool = False, quantized_gradients: list[AxisGroup] | None = None,
                 divisor: int | None = None, part: Callable[[nn.Parameter], int] = lambda param: 0):
        self.stage, self.dp, self.quantized_weights = stage, dp, quantized_weights
        self._all_gather = weight_all_gather(quantized_weights)
        self.shard = dp.rank if stage > 0 else 0
        self.buffers: list[FlatParameterBuffer] = []
        self.group_of: list[int] = []  # the parameter group of each buffer
        for index, params in enumerate(groups):
            for dtype in sorted({p.dtype for p in params}, key=str):
                members = [p for p in params if p.dtype == dtype]
                size = bucket_size_for(bucket_size, sum(p.numel() for p in members), dp.size, min(stage, 2))
                self.buffers.append(FlatParameterBuffer(members, size,
                                                        dp.size if stage > 0 else 1, keep_grad=stage < 2,
                                                        deferred=needs_model_parallel_reduction,
                                                        device=device, grad_dtype=grad_dtype(dtype),
                                                        part=part))
                self.group_of.append(index)
        for buffer in self.buffers:  # every replica starts from data-parallel rank 0's weights
            comm.broadcast(buffer.data, src=dp.ranks[0], group=dp)
        self.grad_sync = GradientSync(self.buffers, dp, min(stage, 2), model_parallel, pool,
                                      quantized_gradients, divisor)
        self._gathers: dict[tuple[int, int], object] = {}  # (buffer, bucket) -> all-gather in flight
        self._hooks: list = []

    def shard_numel(self) -> int:
        """Elements of this rank's master slots (its bucket chunks; stage 0: every bucket)."""
        return sum(bucket.chunk for buffer in self.buffers for bucket in buffer.buckets)

    def add_slots(self, masters: MasterShards, master_groups: list[dict]) -> None:
        """Master slots over each bucket chunk this rank owns (stage 0: each whole bucket), cut to the
        masters' largest size (never views of the chunks when the gather quantizes: it overwrites them)."""
        for index, buffer in enumerate(self.buffers):
            segments = buffer.segments(self.shard)
            for bucket in buffer.buckets:
                low, high = bucket.chunk_range(self.shard)
                masters.add(master_groups[self.group_of[index]], buffer.data[low:high],
                            lambda i=index, b=bucket: self.grad_sync.shard_grad(i, b),
                            [(s.param, s.offset, s.length) for s in segments if s.bucket == bucket.index],
                            [(p, buffer.offsets[p] - bucket.start, p.shape) for p in bucket.params],
                            sharded=self.stage > 0, start=low - bucket.start,
                            aliasable=not self.quantized_weights)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.grad_sync.no_sync()

    def finish(self) -> None:
        """End of backward: every bucket reduced."""
        self.grad_sync.finish()

    def zero_grad(self, set_to_none: bool) -> None:
        """Start a step. ``set_to_none``: the gradient buffers are left as they are and each view is
        overwritten by its parameter's first gradient (``grad_sync``: no pass over the buffers); else they
        are zeroed and attached for autograd to accumulate into."""
        for buffer in self.buffers:
            if set_to_none:
                for param in buffer.params:
                    param.grad = None
            else:
                if buffer.grad is not None:
                    buffer.grad.zero_()
                buffer.attach_grads()
        self.grad_sync.zero(unwritten=set_to_none)

    def gather(self, overlap: bool = False) -> None:
        """Every rank updated its chunks: all-gather each bucket in place (stages 1-2; stage 0 holds all).
        With ``overlap`` the gathers stay in flight, the buckets the first layers need first, and each
        module waits for its own before its forward (``wait_in_forward``)."""
        if self.stage == 0:
            return
        self.wait()
        for index, buffer in reversed(list(enumerate(self.buffers))):
            for bucket in reversed(buffer.buckets):
                low, high = bucket.chunk_range(self.shard)
                self._gathers[index, bucket.index] = self._all_gather(
                    buffer.data[bucket.start:bucket.end], buffer.data[low:high], self.dp, async_op=True)
        if not overlap:
            self.wait()

    @property
    def gathers_in_flight(self) -> int:
        return len(self._gathers)

    def wait(self, keys=None) -> None:
        """Finish the parameter all-gathers in flight (those of ``keys`` only, if given)."""
        for key in list(self._gathers) if keys is None else keys:
            handle = self._gathers.pop(key, None)
            if handle is not None:
                handle.wait()

    def wait_in_forward(self, module: nn.Module) -> None:
        """Forward pre-hooks: a module waits for the buckets that hold its own parameters (Megatron's
        --overlap-param-gather). A parameter must be read in its own module's forward, as every layer here
        is."""
        bucket_of = {param: (index, bucket.index) for index, buffer in enumerate(self.buffers)
                     for bucket in buffer.buckets for param in bucket.params}
        for owner in module.modules():
            keys = sorted({bucket_of[p] for p in owner.parameters(recurse=False) if p in bucket_of})
            if keys:
                self._hooks.append(owner.register_forward_pre_hook(lambda _, args,
                                                                   keys=keys: self.wait(keys)))

    def held(self) -> list[torch.Tensor]:
        """The tensors this storage holds for parameters and gradients (for the byte count)."""
        return [b.data for b in self.buffers] + [b.grad for b in self.buffers if b.grad is not None] + \
            list(self.grad_sync.grad_shards or [])
