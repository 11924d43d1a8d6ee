"""The ZeRO optimizer for stages 0-2: flat buffers, sharded fp32 master weights and optimizer states.

Per flat buffer and bucket, this rank owns one chunk (stage 0: the whole bucket). The wrapped torch
optimizer sees one fp32 "master" tensor per owned chunk: a view of the parameters themselves in fp32
training, an fp32 copy under bf16/fp16. A step: finish the gradient reduction, unscale (fp16), agree
on overflow over all ranks, take the global norm over every axis (each parameter counted once), clip,
step the masters, write them back into the compute-precision parameters and (stages 1-2) all-gather
every bucket so all ranks hold the full updated parameters again.
"""

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
from parallel.zero.grad_sync import GradientSync, ModelParallelGroups, needs_model_parallel_reduction
from parallel.zero.loss_scaler import ConstantLossScaler, DynamicLossScaler

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass
class StepResult:
    """What one optimizer step did: the gradient norm before clipping, whether it was skipped (an
    overflow or a non-finite norm), and the loss scale in force during the step."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank's copy of ``param`` is the one that counts in a sum over the whole model.

    Tensor-parallel slices count everywhere; weights replicated over tp count on tp rank 0 only; the
    last pipeline stage's copy of the tied embedding (``tied_copy``) never counts.
    """
    if getattr(param, "tied_copy", False):
        return False
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ZeroOptimizer:
    """Data-parallel training with ZeRO stage 0, 1 or 2 over ``dp``.

    Owns the flat buffers (parameters become views into them), the gradient sync, the master chunks,
    the wrapped torch optimizer (which only ever sees this rank's chunks) and the loss scaler. Its
    ``zero_grad`` keeps gradient views attached (never sets them to None). It never changes which
    parameters a module has, and never communicates outside ``dp`` except for the norm and the
    overflow decision.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, dp: AxisGroup, *, stage: int,
                 param_groups: list[dict] | None = None, bucket_size: int = 40_000_000, clip_grad: float = 0.0,
                 model_parallel: ModelParallelGroups | None = None, loss_scaler=None):
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer takes stages 0-2, not {stage}")
        self.module, self.dp, self.stage, self.clip_grad = module, dp, stage, clip_grad
        self.model_parallel = model_parallel or ModelParallelGroups()
        self.loss_scaler = loss_scaler or ConstantLossScaler()
        param_groups = param_groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
        self.params = [p for group in param_groups for p in group["params"]]
        shards = dp.size if stage > 0 else 1
        self.shard = dp.rank if stage > 0 else 0
        self.buffers: list[FlatParameterBuffer] = []
        master_groups = []
        for group in param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            masters = []
            for dtype in sorted({p.dtype for p in group["params"]}, key=str):
                buffer = FlatParameterBuffer([p for p in group["params"] if p.dtype == dtype], bucket_size, shards,
                                             keep_grad=stage < 2, deferred=needs_model_parallel_reduction)
                self.buffers.append(buffer)
                masters += [self._master(buffer, bucket) for bucket in buffer.buckets]
            if masters:
                master_groups.append({"params": masters, **options})
        self.masters = [m for group in master_groups for m in group["params"]]
        self.grad_sync = GradientSync(self.buffers, dp, stage, self.model_parallel)
        self.optimizer = optimizer_factory(master_groups)
        self._broadcast_parameters()

    def _master(self, buffer: FlatParameterBuffer, bucket) -> nn.Parameter:
        low, high = bucket.chunk_range(self.shard)
        chunk = buffer.data[low:high]
        return nn.Parameter(chunk if chunk.dtype == torch.float32 else chunk.detach().float())

    def _broadcast_parameters(self) -> None:
        """Start every replica from data-parallel rank 0's weights (and masters from them)."""
        for buffer in self.buffers:
            comm.broadcast(buffer.data, src=self.dp.ranks[0], group=self.dp)
        self._each_chunk(lambda master, chunk: master.data.copy_(chunk) if master.data_ptr() != chunk.data_ptr()
                         else None)

    def _each_chunk(self, fn) -> None:
        masters = iter(self.masters)
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                low, high = bucket.chunk_range(self.shard)
                fn(next(masters), buffer.data[low:high])

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale)."""
        return loss * self.loss_scale

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside this context accumulates gradients without communicating (stages 0-1)."""
        return self.grad_sync.no_sync()

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            if buffer.grad is not None:
                buffer.grad.zero_()
            buffer.attach_grads()
        self.grad_sync.zero()

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients of the master chunks, unscaled (views where no conversion is needed)."""
        grads = []
        for index, buffer in enumerate(self.buffers):
            for bucket in buffer.buckets:
                grad = self.grad_sync.shard_grad(index, bucket)
                grad = grad if grad.dtype == torch.float32 else grad.float()
                grads.append(grad.div_(self.loss_scale) if self.loss_scale != 1.0 else grad)
        return grads

    def _global_sum(self, value: torch.Tensor, op=torch.distributed.ReduceOp.SUM, over_dp: bool = True) -> None:
        if over_dp:
            comm.all_reduce(value, self.dp, op=op)
        if self.model_parallel.model_parallel is not None:
            comm.all_reduce(value, self.model_parallel.model_parallel, op=op)

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over the whole model: each parameter once, wherever its chunks live."""
        tp_rank = self.model_parallel.tp.rank if self.model_parallel.tp is not None else 0
        starts, position = {}, 0
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                starts[(id(buffer), bucket.index)] = position
                position += 1
        total = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for buffer in self.buffers:
            for segment in buffer.segments(self.shard):
                if counts_once_here(segment.param, tp_rank):
                    grad = grads[starts[(id(buffer), segment.bucket)]]
                    total += grad[segment.offset:segment.offset + segment.length].pow(2).sum()
        self._global_sum(total, over_dp=self.stage > 0)  # stage 0: every dp rank holds the same sum
        return total.sqrt().item()

    def step(self) -> StepResult:
        scale = self.loss_scale
        self.grad_sync.finish()
        grads = self._master_grads()
        overflow = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        if isinstance(self.loss_scaler, DynamicLossScaler):
            for grad in grads:
                if not torch.isfinite(grad).all():
                    overflow.fill_(1.0)
                    break
            self._global_sum(overflow, op=torch.distributed.ReduceOp.MAX)
        norm = self._grad_norm(grads)
        skipped = bool(overflow.item()) or not math.isfinite(norm)
        self.loss_scaler.update(skipped)
        if skipped:
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
        coefficient = self.clip_grad / (norm + 1e-6) if 0 < self.clip_grad < norm else 1.0
        for master, grad in zip(self.masters, grads):
            master.grad = grad.mul_(coefficient) if coefficient != 1.0 else grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self._each_chunk(lambda master, chunk: chunk.copy_(master.data) if master.data_ptr() != chunk.data_ptr()
                         else None)
        if self.stage > 0:
            self._gather_parameters()
        return StepResult(grad_norm=norm, loss_scale=scale)

    def _gather_parameters(self) -> None:
        """Every rank updated its chunks: all-gather each bucket in place."""
        handles = []
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                low, high = bucket.chunk_range(self.shard)
                handles.append(comm.all_gather_into_tensor(buffer.data[bucket.start:bucket.end],
                                                           buffer.data[low:high], self.dp, async_op=True))
        for handle in handles:
            handle.wait()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    def model_state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients, master copies and optimizer states (measured)."""
        tensors = [b.data for b in self.buffers] + [b.grad for b in self.buffers if b.grad is not None]
        tensors += list(self.grad_sync.grad_shards or []) + [m.data for m in self.masters]
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if torch.is_tensor(t) and t.numel() > 1]
        return _storage_bytes(tensors) + sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                                             for t in s.values() if torch.is_tensor(t) and t.numel() <= 1)


def expected_model_state_bytes(stage: int, params: int, dp: int, compute_bytes: int) -> float:
    """DESIGN.md's formula, generalised to the compute precision: parameters and gradients in
    ``compute_bytes`` each, plus fp32 master (when not the parameters themselves) and Adam's two fp32
    moments, sharded over ``dp`` as the stage says."""
    master = 4 if compute_bytes != 4 else 0
    states = master + 8
    if stage == 0:
        return params * (2 * compute_bytes + states)
    if stage == 1:
        return params * (2 * compute_bytes) + params * states / dp
    return params * compute_bytes + params * (compute_bytes + states) / dp
