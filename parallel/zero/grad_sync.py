"""Bucketed gradient reduction over the data-parallel group, overlapped with backward.

A hook on each parameter counts the gradients that are ready; when all of a bucket's gradients have
arrived, its collective starts asynchronously while backward goes on with earlier layers (one rank at
stages 0-1 needs no hook: autograd accumulates in place, nothing is reduced). Three ways, one per ZeRO
stage:

    stage 0  all-reduce the bucket of the flat gradient buffer in place (every rank keeps all)
    stage 1  reduce-scatter the bucket in place: each rank's chunk ends up holding its reduced part
    stage 2  no flat gradient buffer: each gradient is copied into its bucket's staging slot as it
             arrives and freed; a full bucket is reduce-scattered into this rank's gradient shard
             (which keeps the earlier micro-batches' sum); this happens on every micro-batch, so no
             full gradient outlives its copy (sent as int8 by a hierarchical all-to-all with
             ``quantized_gradients``, ZeRO++'s qgZ)

Stages 0 and 1 reduce only on the last micro-batch (backwards before it run inside ``no_sync``).
Deferred buckets (sequence-parallel and tied-embedding weights) wait for ``finish``: their
gradients are first summed over the tensor-parallel or embedding group, then reduced like the rest.
Gradients are pre-divided by the data-parallel size (gloo has no average), or by ``divisor``: an expert's
gradient, summed over the expert data-parallel group, averages the losses of the whole data x context group.

Gradients are accumulated and reduced in the buffers' gradient dtype: fp32 for bf16 or fp16
parameters by default (each micro-batch's gradient is added into the fp32 buffer or, at stage 2,
reduced in fp32 into an fp32 shard), the parameters' dtype with ``--grad-reduce-in-bf16``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from parallel import comm
from parallel.buffer_pool import BufferPool
from parallel.comm import AxisGroup
from parallel.param_meta import meta
from parallel.zero.flat_parameter_buffer import Bucket, FlatParameterBuffer
from parallel.zero.shard_reduce_scatter import ShardReduceScatter


@dataclass
class ModelParallelGroups:
    """The groups beyond data parallelism that gradients and their norm must see.

    ``tp``: sums gradients of sequence-parallel replicated weights and decides which replicas count
    in the norm; ``model_parallel``: tp x pp, over which the norm is summed; ``embedding``: first and
    last pipeline stage, over which the tied embedding's gradient is summed.
    """

    tp: AxisGroup | None = None
    model_parallel: AxisGroup | None = None
    embedding: AxisGroup | None = None


def needs_model_parallel_reduction(param: nn.Parameter) -> bool:
    return meta(param).sequence_parallel or meta(param).tied_embedding


def reduce_model_parallel_grad(param: nn.Parameter, grad: torch.Tensor, groups: ModelParallelGroups) -> None:
    """Sum the partial gradient that tensor/pipeline parallelism leaves in ``grad``, in place."""
    if meta(param).sequence_parallel and groups.tp is not None:
        comm.all_reduce(grad, groups.tp)
    if meta(param).tied_embedding and groups.embedding is not None:
        comm.all_reduce(grad, groups.embedding)


SMALLEST_BUCKET = 1 << 20  # elements: below this a bucket's collective costs more than it overlaps or saves
OVERLAPPED_BUCKETS = 4  # a buffer is cut into at least this many: the first reduces while backward goes on


def bucket_size_for(bucket_size: int, numel: int, dp: int, stage: int) -> int:
    """The bucket size of a flat buffer of ``numel`` elements: at most ``bucket_size``, and at most a
    ``OVERLAPPED_BUCKETS``-th of the buffer, so that its reductions overlap backward at every model size
    (as DDP's 25 MB buckets do; a buffer within one bucket reduces after backward, all of it exposed). At
    stage 2 also small enough that its two staging slots hold at most half of the gradient memory that
    sharding saves ((dp - 1) / dp of the buffer), so that stage 2 holds less than stage 1. Never below
    ``SMALLEST_BUCKET`` (4 MB of fp32: more, smaller collectives would cost latency for overlap and memory
    that do not matter). (A bucket closes at the first parameter that reaches the size, so a single larger
    parameter still gets a bucket, and a slot, of its own.)"""
    if dp == 1:
        return bucket_size
    share = -(-numel // OVERLAPPED_BUCKETS)
    if stage == 2:
        share = min(share, numel * (dp - 1) // (4 * dp))
    return min(bucket_size, max(SMALLEST_BUCKET, share))


class GradientSync:
    """Reduces the gradients of flat buffers over ``dp`` as stage ``stage`` requires.

    Owns the per-bucket readiness counts, the in-flight handles and (stage 2) the gradient shards
    the reductions accumulate into. Never changes parameter values.
    """

    def __init__(self, buffers: list[FlatParameterBuffer], dp: AxisGroup, stage: int,
                 model_parallel: ModelParallelGroups, pool: BufferPool,
                 quantized_gradients: list[AxisGroup] | None = None, divisor: int | None = None):
        self.buffers, self.dp, self.stage, self.model_parallel = buffers, dp, stage, model_parallel
        self.divisor = dp.size if divisor is None else divisor  # the sums are averages over this many
        self.enabled = True
        self.grad_shards = ([torch.zeros(b.numel // dp.size, dtype=b.grad_dtype, device=b.device)
                             for b in buffers] if stage == 2 else None)
        self._bucket_of: dict[nn.Parameter, tuple[int, Bucket]] = {}
        for index, buffer in enumerate(buffers):
            for bucket in buffer.buckets:
                for param in bucket.params:
                    self._bucket_of[param] = (index, bucket)
        self._ready: dict[tuple[int, int], int] = {}
        self._in_flight: dict[tuple[int, int], object] = {}  # stages 0-1: in-place reductions
        # stage 2: two staging slots per gradient dtype in the buffer pool (one filling, one being reduced)
        self._staging: dict[torch.dtype, ShardReduceScatter] = {}
        if stage == 2:
            for dtype in {b.grad_dtype for b in buffers}:
                largest = max(k.numel for b in buffers if b.grad_dtype == dtype for k in b.buckets)
                self._staging[dtype] = ShardReduceScatter(pool, f"grad-staging-{dtype}", largest, dtype, dp,
                                                           quantized_gradients, self.divisor)
        self._launched: set[tuple[int, int]] = set()
        # parameters whose gradient-buffer view holds last step's values: the first gradient is copied in
        self._unwritten: set[nn.Parameter] = set()
        self._filling: dict[tuple[int, int], tuple[torch.Tensor, set]] = {}  # stage 2: staging, params in it
        # stage 2: deferred gradients in the gradient dtype
        self._deferred: dict[nn.Parameter, torch.Tensor] = {}
        # one rank whose gradients autograd accumulates in place in the buffer: nothing to reduce, no hook
        self._alone = dp.size == 1 and self.divisor == 1 and stage < 2 and all(b.grads_are_views
                                                                              for b in buffers)
        self._hooks = [] if self._alone else \
            [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._bucket_of]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches before the last). Stage 2 reduces anyway."""
        previous, self.enabled = self.enabled, self.stage == 2
        try:
            yield
        finally:
            self.enabled = previous

    def shard_grad(self, buffer_index: int, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradient chunk of ``bucket`` (valid after ``finish``)."""
        if self.stage == 2:
            offset = sum(b.chunk for b in self.buffers[buffer_index].buckets[:bucket.index])
            return self.grad_shards[buffer_index][offset:offset + bucket.chunk]
        low, high = bucket.chunk_range(self.dp.rank) if self.stage == 1 else (bucket.start, bucket.end)
        return self.buffers[buffer_index].grad[low:high]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index, bucket = self._bucket_of[param]
        buffer = self.buffers[index]
        if buffer.grad is not None:
            # a fresh gradient, not the view autograd accumulates into: of another dtype (added into the fp32
            # main gradient, then dropped), or the first one after zero_grad(set_to_none=True)
            view = buffer.grad_view(param)
            if param.grad is not view and param.grad.data_ptr() != view.data_ptr():
                self._accumulate(param, view, param.grad)
                param.grad = view if buffer.grads_are_views else None
        elif bucket.deferred and buffer.grad is None and buffer.grad_dtype != param.dtype:
            # stage 2 reduces deferred gradients only in ``finish``: accumulate them in fp32 until then
            if param in self._deferred:
                self._deferred[param].add_(param.grad)
            else:
                self._deferred[param] = param.grad.to(buffer.grad_dtype)
            param.grad = None
        if not self.enabled or bucket.deferred:
            return
        key = (index, bucket.index)
        if self.stage < 2 and key in self._launched:
            raise RuntimeError("a parameter received a second gradient after its bucket was already being "
                               "reduced: run every backward but the last of an accumulation inside "
                               "optimizer.no_sync()")
        if self.stage == 2:
            self._stage(index, bucket, param)
        self._ready[key] = self._ready.get(key, 0) + 1
        if self._ready[key] == len(bucket.params):
            self._launch(index, bucket)

    def _accumulate(self, param: nn.Parameter, view: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Add ``grad`` into ``param``'s buffer view (its first of the step overwrites the view; None: no
        gradient, a zero)."""
        if param in self._unwritten:
            self._unwritten.discard(param)
            view.zero_() if grad is None else view.copy_(grad)
        elif grad is not None:
            view.add_(grad)

    def _stage(self, index: int, bucket: Bucket, param: nn.Parameter) -> None:
        """Stage 2: copy ``param``'s gradient into its bucket's staging slot (opened by the bucket's first
        gradient) and free it."""
        key, buffer = (index, bucket.index), self.buffers[index]
        if key not in self._filling:
            staging = self._staging[buffer.grad_dtype].open(key, bucket.numel,
                                                            lambda: self.shard_grad(index, bucket))
            self._filling[key] = (staging, set())
        staging, filled = self._filling[key]
        self._put(staging, buffer, bucket, param, param.grad)
        param.grad = None  # the full gradient is released here
        filled.add(param)

    @staticmethod
    def _put(staging: torch.Tensor, buffer: FlatParameterBuffer, bucket: Bucket, param: nn.Parameter,
             grad: torch.Tensor | None) -> None:
        """``param``'s range of its bucket's staging: ``grad``, or zeros where it has none."""
        start, end = buffer.param_range(param)
        target = staging[start - bucket.start:end - bucket.start]
        if grad is None:
            target.zero_()
        else:
            target.copy_(grad.view(-1))

    def _launch(self, index: int, bucket: Bucket) -> None:
        key = (index, bucket.index)
        self._ready[key] = 0
        self._launched.add(key)
        buffer = self.buffers[index]
        if self.stage == 2:
            staged = self._staging[buffer.grad_dtype]
            staging, filled = self._filling.pop(key, None) or \
                (staged.open(key, bucket.numel, lambda: self.shard_grad(index, bucket)), set())
            for param in bucket.params:  # those not staged as they arrived: deferred, or without a gradient
                if param not in filled:
                    self._put(staging, buffer, bucket, param, self._deferred.pop(param, param.grad))
                    param.grad = None
            staging[sum(p.numel() for p in bucket.params):].zero_()  # the bucket's padding
            staged.start(key)
            return
        grads = buffer.grad[bucket.start:bucket.end]
        if self.divisor > 1:
            grads.div_(self.divisor)
        if self.stage == 0:
            handle = comm.all_reduce(grads, self.dp, async_op=True)
        else:
            low, high = bucket.chunk_range(self.dp.rank)
            handle = comm.reduce_scatter_tensor(buffer.grad[low:high], grads, self.dp, async_op=True)
        self._in_flight[key] = handle

    def _complete(self, key: tuple[int, int]) -> None:
        """Wait for a stage 0-1 bucket's in-place reduction."""
        handle = self._in_flight.pop(key, None)
        if handle is not None:
            handle.wait()

    def finish(self) -> None:
        """Complete the reduction of every bucket, in bucket order (the same on every rank)."""
        if self._alone:
            self._finish_alone()
            return
        self._sum_tied_here(self._deferred_grad)
        for index, buffer in enumerate(self.buffers):
            for bucket in buffer.buckets:
                key = (index, bucket.index)
                if buffer.grad is not None:  # a view no gradient reached this step is a zero
                    for param in bucket.params:
                        if param in self._unwritten:
                            self._accumulate(param, buffer.grad_view(param), None)
                if bucket.deferred:
                    for param in bucket.params:
                        grad = self._deferred_grad(buffer, param)
                        if grad is not None:
                            reduce_model_parallel_grad(param, grad, self.model_parallel)
                    self._launch(index, bucket)
                elif key not in self._launched or self._ready.get(key, 0) > 0:
                    self._launch(index, bucket)  # parameters without gradients in this step
        for key in list(self._in_flight):
            self._complete(key)
        for staged in self._staging.values():
            staged.finish()
        self._ready.clear()
        self._launched.clear()

    def _deferred_grad(self, buffer: FlatParameterBuffer, param: nn.Parameter) -> torch.Tensor | None:
        """The gradient a deferred bucket reduces for ``param``: its buffer view, or at stage 2 the fp32 sum
        kept until ``finish`` (or the gradient itself)."""
        return buffer.grad_view(param) if buffer.grad is not None else self._deferred.get(param, param.grad)

    def _sum_tied_here(self, grad_of) -> None:
        """Where this rank holds both the tied embedding and its copy (zbv's first stage holds both ends of
        the model), sum their gradients here, as the embedding group's all-reduce sums them across ranks
        (the group is then this rank alone). ``grad_of(buffer, param)``: the gradient to sum into."""
        tied = [grad for buffer in self.buffers for param in buffer.params if meta(param).tied_embedding
                if (grad := grad_of(buffer, param)) is not None]
        if len(tied) > 1:
            total = torch.stack(tied).sum(0)
            for grad in tied:
                grad.copy_(total)

    def _finish_alone(self) -> None:
        """One rank, no hooks: a gradient autograd made after ``zero_grad(set_to_none=True)`` joins its view
        of the buffer now; the tensor- and pipeline-parallel sums still run."""
        for buffer in self.buffers:
            for param in buffer.params:
                view = buffer.grad_view(param)
                if param.grad is not view:
                    grad = param.grad
                    self._accumulate(param, view, grad)
                    if grad is not None:
                        param.grad = view
        self._sum_tied_here(lambda buffer, param: buffer.grad_view(param))
        for buffer in self.buffers:
            for param in buffer.params:
                if needs_model_parallel_reduction(param):  # on every rank of the group, gradient or not
                    reduce_model_parallel_grad(param, buffer.grad_view(param), self.model_parallel)

    def zero(self, unwritten: bool = False) -> None:
        """Start a new step: clear the gradient shards (stage 2); ``unwritten``: the flat buffers' views were
        not zeroed, each parameter's first gradient overwrites its view."""
        for shard in self.grad_shards or []:
            shard.zero_()
        self._unwritten = {param for buffer in self.buffers if buffer.grad is not None
                           for param in buffer.params} if unwritten else set()
