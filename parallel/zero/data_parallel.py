"""ZeRO stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.comm import AxisGroup
from parallel.zero.flat_buffer import FlatParameterBuffer
from parallel.zero.grad_norm import global_grad_norm
from parallel.zero.grad_sync import BucketedAllReduce

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass
class StepResult:
    """What one optimizer step did: the gradient norm before clipping, and whether it was skipped."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


@dataclass
class ModelParallelGroups:
    """The groups beyond data parallelism that gradients and their norm must see.

    ``tp``: reduces gradients of sequence-parallel replicated weights and decides which replicas count
    in the norm; ``model_parallel``: tp x pp, over which the norm is summed; ``embedding``: first and
    last pipeline stage, over which the tied embedding's gradient is summed.
    """

    tp: AxisGroup | None = None
    model_parallel: AxisGroup | None = None
    embedding: AxisGroup | None = None


def reduce_model_parallel_grads(params: list[nn.Parameter], groups: ModelParallelGroups) -> None:
    """Sum the partial gradients that tensor/pipeline parallelism leaves behind, before the step."""
    if groups.tp is not None and groups.tp.size > 1:
        for param in params:
            if getattr(param, "sequence_parallel", False) and param.grad is not None:
                comm.all_reduce(param.grad, groups.tp)
    if groups.embedding is not None and groups.embedding.size > 1:
        for param in params:
            if getattr(param, "tied_embedding", False) and param.grad is not None:
                comm.all_reduce(param.grad, groups.embedding)


class DataParallelOptimizer:
    """Stage 0: each data-parallel rank keeps full parameters, gradients and optimizer states.

    Owns the flat buffers (parameters become views into them), the bucketed all-reduce, clipping
    and the wrapped torch optimizer. Its ``zero_grad`` zeroes the flat gradients in place (never
    sets them to None, which would detach the views). It never shards anything.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, dp: AxisGroup, *,
                 param_groups: list[dict] | None = None, bucket_size: int = 40_000_000, clip_grad: float = 0.0,
                 model_parallel: ModelParallelGroups | None = None):
        self.module, self.dp, self.clip_grad = module, dp, clip_grad
        self.model_parallel = model_parallel or ModelParallelGroups()
        param_groups = param_groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
        self.params = [p for group in param_groups for p in group["params"]]
        self.buffers = []
        for dtype in sorted({p.dtype for p in self.params}, key=str):
            self.buffers.append(FlatParameterBuffer([p for p in self.params if p.dtype == dtype], bucket_size))
        self.grad_sync = BucketedAllReduce(self.buffers, dp)
        self.optimizer = optimizer_factory(param_groups)
        self._broadcast_parameters()

    def _broadcast_parameters(self) -> None:
        """Start every replica from data-parallel rank 0's weights."""
        for buffer in self.buffers:
            comm.broadcast(buffer.data, src=self.dp.ranks[0], group=self.dp)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside this context accumulates gradients without communicating."""
        return self.grad_sync.no_sync()

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.grad.zero_()
            buffer.attach_grads()

    def step(self) -> StepResult:
        self.grad_sync.finish()
        reduce_model_parallel_grads(self.params, self.model_parallel)
        tp_rank = self.model_parallel.tp.rank if self.model_parallel.tp is not None else 0
        groups = [self.model_parallel.model_parallel] if self.model_parallel.model_parallel is not None else []
        norm = global_grad_norm([(p, p.grad) for p in self.params], tp_rank, groups).item()
        if not math.isfinite(norm):
            return StepResult(grad_norm=norm, skipped=True)
        if self.clip_grad > 0 and norm > self.clip_grad:
            coefficient = self.clip_grad / (norm + 1e-6)
            for buffer in self.buffers:
                buffer.grad.mul_(coefficient)
        self.optimizer.step()
        return StepResult(grad_norm=norm)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def model_state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients and optimizer states (measured)."""
        total = sum(b.data.numel() * b.data.element_size() + b.grad.numel() * b.grad.element_size()
                    for b in self.buffers)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return total
