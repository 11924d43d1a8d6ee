"""The ZeRO optimizer for stages 0-3: flat buffers or sharded units, fp32 master shards, any optimizer,
optionally offloaded to the CPU or to swap files (ZeRO-Offload / ZeRO-Infinity).

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
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.buffers import BufferPool
from parallel.comm import AxisGroup
from parallel.param_meta import meta
from parallel.zero.flat_buffer import FlatParameterBuffer
from parallel.zero.grad_sync import GradientSync, ModelParallelGroups, needs_model_parallel_reduction
from parallel.zero.memory import sharded_at_stage_3
from parallel.zero.loss_scaler import ConstantLossScaler, DynamicLossScaler
from parallel.zero.offload import SwappedOptimizerStates, is_per_element
from parallel.zero.stage3 import ShardedParameters
from parallel.zero.swap import SwapSpace

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass
class StepResult:
    """What one optimizer step did: the gradient norm before clipping, whether it was skipped (an
    overflow or a non-finite norm), and the loss scale in force during the step."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


def module_device(module: nn.Module) -> torch.device:
    """Where the module computes; a module built on the meta device is materialised on this process's
    default device."""
    device = next(module.parameters()).device
    if device.type == "meta":
        from parallel.process_groups import default_device

        return default_device()
    return device


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank's copy of ``param`` is the one that counts in a sum over the whole model.

    Tensor-parallel slices count everywhere; weights replicated over tp count on tp rank 0 only; the
    last pipeline stage's copy of the tied embedding (``tied_copy``) never counts.
    """
    declared = meta(param)
    if declared.tied_copy:
        return False
    return declared.tensor_parallel or tp_rank == 0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass
class ShardSlot:
    """One contiguous piece of this rank's shard: where its compute-precision values live, how to get
    its reduced gradient, its fp32 master, and which parameter elements it holds (for the norm)."""

    data: torch.Tensor
    grad: Callable[[], torch.Tensor]
    master: nn.Parameter
    segments: list[tuple[nn.Parameter, int, int]]  # (parameter, offset in this slot, length)
    layout: list[tuple[nn.Parameter, int, torch.Size]]  # every parameter of the whole range: (param, offset, shape)
    sharded: bool  # the slot is this rank's chunk of a range split over dp (else the whole range)
    store: Callable[[torch.Tensor, bool], None] | None = None  # keeps stepped values (stage 3; non-blocking?)


@dataclass(frozen=True)
class MasterPiece:
    """``length`` elements of ``param`` (whose shape on this rank is ``shape``: a freed stage-3 parameter
    is empty), from element ``start``, at ``offset`` of master ``master``, whose torch-optimizer state is
    number ``state``."""

    master: int
    state: int
    param: nn.Parameter
    shape: torch.Size
    start: int
    offset: int
    length: int


class ZeroOptimizer:
    """Data-parallel training with ZeRO stage 0, 1, 2 or 3 over ``dp``.

    Owns the flat buffers (parameters become views into them), the stage-3 sharded units, the gradient
    sync, the master chunks, the wrapped torch optimizer (which only ever sees this rank's chunks) and
    the loss scaler. ``zero_grad`` follows torch (``set_to_none``); the gradient buffers own the sums. It
    never changes which parameters a module has, and never communicates outside ``dp`` except for the
    norm and the overflow decision.

    Stage 3 shards the parameters of ``unit_modules`` (each parameter belongs to the innermost one
    holding it; the rest to ``module``) above ``persistence_threshold`` elements; smaller ones, and
    those whose gradients need a tensor/pipeline reduction first, stay whole as in stage 2.

    Offload (stages 1-3): ``offload_optimizer="cpu"`` keeps the masters, states and step on the CPU;
    ``"nvme"`` keeps them in swap files under ``nvme_path``, stepped ``sub_group_size`` elements at a
    time (``SwappedOptimizerStates``). ``offload_param="nvme"`` (stage 3) keeps the parameter shards in
    swap files, read ahead of their gathers. ``close()`` removes the swap files.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, dp: AxisGroup, *, stage: int,
                 param_groups: list[dict] | None = None, bucket_size: int = 40_000_000, clip_grad: float = 0.0,
                 model_parallel: ModelParallelGroups | None = None, loss_scaler=None,
                 unit_modules: list[nn.Module] | None = None, persistence_threshold: int = 100_000,
                 prefetch_budget: int | None = 0, buffer_pool: BufferPool | None = None,
                 offload_optimizer: str = "none",
                 nvme_path: str | None = None, sub_group_size: int = 100_000_000, offload_param: str = "none",
                 main_grads_in_fp32: bool = True, overlap_param_gather: bool = False):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {stage} is unknown: choose 0, 1, 2 or 3")
        if offload_optimizer not in ("none", "cpu", "nvme"):
            raise ValueError(f"--offload-optimizer {offload_optimizer} is unknown: choose none, cpu or nvme")
        if offload_optimizer != "none" and stage == 0:
            raise ValueError(f"--offload-optimizer {offload_optimizer} needs --zero-stage 1, 2 or 3 (stage 0 keeps "
                             "no optimizer shard to offload)")
        if offload_param not in ("none", "nvme"):
            raise ValueError(f"--offload-param {offload_param} is not available: choose none or nvme")
        if offload_param == "nvme" and stage != 3:
            raise ValueError("--offload-param nvme needs --zero-stage 3 (only stage 3 shards the parameters)")
        # offloaded masters, their states and the step live on the CPU (swapped to files with nvme)
        self.master_device = torch.device("cpu") if offload_optimizer != "none" else None
        self.module, self.dp, self.stage, self.clip_grad = module, dp, stage, clip_grad
        self.main_grads_in_fp32 = main_grads_in_fp32
        self.overlap_param_gather = overlap_param_gather
        self._pending_gathers: dict[tuple[int, int], object] = {}  # (buffer, bucket) -> all-gather in flight
        self.model_parallel = model_parallel or ModelParallelGroups()
        self.loss_scaler = loss_scaler or ConstantLossScaler()
        param_groups = param_groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
        self.params = [p for group in param_groups for p in group["params"]]
        self.shard = dp.rank if stage > 0 else 0
        device = module_device(module)
        sharded = (lambda p: sharded_at_stage_3(p, persistence_threshold)) if stage == 3 else (lambda p: False)
        self.buffers: list[FlatParameterBuffer] = []
        self.slots: list[ShardSlot] = []
        master_groups = []
        buffer_groups = []
        for group in param_groups:
            whole = [p for p in group["params"] if not sharded(p)]
            for dtype in sorted({p.dtype for p in whole}, key=str):
                buffer = FlatParameterBuffer([p for p in whole if p.dtype == dtype], bucket_size,
                                             dp.size if stage > 0 else 1, keep_grad=stage < 2,
                                             deferred=needs_model_parallel_reduction, device=device,
                                             grad_dtype=self.grad_dtype(dtype))
                self.buffers.append(buffer)
                buffer_groups.append(len(master_groups))
            master_groups.append({"params": [], **{k: v for k, v in group.items() if k != "params"}})
        self._broadcast_parameters()
        self.buffer_pool = buffer_pool or BufferPool(device)
        self.grad_sync = GradientSync(self.buffers, dp, min(stage, 2), self.model_parallel, self.buffer_pool)
        for index, (buffer, group_index) in enumerate(zip(self.buffers, buffer_groups)):
            segments = buffer.segments(self.shard)
            for bucket in buffer.buckets:
                low, high = bucket.chunk_range(self.shard)
                self._add_slot(master_groups[group_index], buffer.data[low:high],
                               lambda i=index, b=bucket: self.grad_sync.shard_grad(i, b),
                               [(s.param, s.offset, s.length) for s in segments if s.bucket == bucket.index],
                               [(p, buffer.offsets[p] - bucket.start, p.shape) for p in bucket.params])
        self.units = None
        if stage == 3:
            self.units = ShardedParameters(self._units(module, unit_modules or [], param_groups, sharded), dp,
                                           self.buffer_pool, device, prefetch_budget, self.grad_dtype)
            for unit in self.units.units:
                low, high = self.shard * unit.chunk, (self.shard + 1) * unit.chunk
                segments = []
                for param in unit.params:
                    start, end = unit.offsets[param], unit.offsets[param] + unit.size(param)
                    if start < high and end > low:
                        segments.append((param, max(start, low) - low, min(end, high) - max(start, low)))
                self._add_slot(master_groups[unit.group], self.units.shard(unit),
                               lambda u=unit: self.units.grad_shard(u), segments,
                               [(p, unit.offsets[p], unit.shapes[p]) for p in unit.params],
                               store=lambda values, non_blocking, u=unit: self.units.store(u, values, non_blocking),
                               aliasable=offload_param == "none")  # a shard in a file cannot be the master
        self.masters = [slot.master for slot in self.slots]
        self._gather_hooks = self._wait_in_forward() if overlap_param_gather and stage in (1, 2) else []
        self.optimizer = optimizer_factory([g for g in master_groups if g["params"]])
        self.swapped = None
        if offload_optimizer == "nvme":
            space = SwapSpace(nvme_path, f"zero-optimizer-pid{os.getpid()}")
            self._close_swap = weakref.finalize(self, space.close)  # swap files are scratch: gone with us
            resident = {i for i, slot in enumerate(self.slots) if slot.master.data_ptr() == slot.data.data_ptr()}
            self.swapped = SwappedOptimizerStates(self.optimizer, self.masters, resident, space, self.buffer_pool,
                                                  sub_group_size)
        if offload_param == "nvme":
            space = SwapSpace(nvme_path, f"zero-params-pid{os.getpid()}")
            self._close_param_swap = weakref.finalize(self, space.close)
            self.units.swap_out(space)

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``param_dtype`` parameters are accumulated and reduced in: fp32 main
        gradients for 16-bit parameters (Megatron's default), unless ``main_grads_in_fp32`` is off."""
        return torch.float32 if self.main_grads_in_fp32 and param_dtype in (torch.bfloat16, torch.float16) \
            else param_dtype

    def _add_slot(self, group: dict, data: torch.Tensor, grad, segments, layout, store=None,
                  aliasable: bool = True) -> None:
        device = self.master_device or data.device
        aliased = aliasable and data.dtype == torch.float32 and data.device == device  # the parameters are the masters
        if aliased:
            master = nn.Parameter(data)
        else:  # offloaded masters of accelerator parameters live in pinned memory: copies to and fro run async
            pinned = device.type == "cpu" and data.device.type != "cpu"
            master = nn.Parameter(torch.empty(data.shape, dtype=torch.float32, device=device, pin_memory=pinned)
                                  .copy_(data.detach()))
        group["params"].append(master)
        self.slots.append(ShardSlot(data, grad, master, segments, layout, sharded=self.stage > 0, store=store))

    @staticmethod
    def _units(module: nn.Module, unit_modules: list[nn.Module], param_groups: list[dict], sharded):
        """(name, module, params, group) per unit: parameters by innermost unit module, group and dtype."""
        owners = [module] + [m for m in unit_modules if m is not module]
        names = {m: name or "model" for name, m in module.named_modules()}
        owner_of = {}
        for owner in owners:  # later (inner) owners overwrite outer ones
            for param in owner.parameters():
                owner_of[param] = owner
        units = []
        for owner in owners:
            for group_index, group in enumerate(param_groups):
                mine = [p for p in group["params"] if sharded(p) and owner_of.get(p) is owner]
                for dtype in sorted({p.dtype for p in mine}, key=str):
                    units.append((names.get(owner, type(owner).__name__), owner,
                                  [p for p in mine if p.dtype == dtype], group_index))
        return units

    def _broadcast_parameters(self) -> None:
        """Start every replica from data-parallel rank 0's weights."""
        for buffer in self.buffers:
            comm.broadcast(buffer.data, src=self.dp.ranks[0], group=self.dp)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the next accumulation: zero the gradient buffers and shards. torch's ``set_to_none``
        (its default) leaves every ``param.grad`` None until backward; the buffers still accumulate (the
        first gradient of a step is added into its buffer view, which ``param.grad`` becomes again).
        ``set_to_none=False`` keeps the views attached (no transient gradient per parameter)."""
        for buffer in self.buffers:
            if buffer.grad is not None:
                buffer.grad.zero_()
            if set_to_none:
                for param in buffer.params:
                    param.grad = None
            else:
                buffer.attach_grads()
        self.grad_sync.zero()
        if self.units is not None:
            self.units.zero()

    def _master_grad(self, index: int, scale: float, coefficient: float, landed: bool = True) -> torch.Tensor:
        """Master ``index``'s fp32 gradient, unscaled (the loss ``scale`` of its backward) and clipped by
        ``coefficient``, on the master's device
        (in place where no conversion is needed). Made one master at a time when it is stepped, so that
        with NVMe offload only the sub-groups in flight hold an fp32 copy. An offloaded master's gradient
        comes down to pinned host memory asynchronously: with ``landed`` False the caller must
        ``_copies_landed()`` before the host reads it."""
        grad = self.slots[index].grad()
        grad = grad if grad.dtype == torch.float32 else grad.float()
        if scale != 1.0:
            grad.div_(scale)
        if coefficient != 1.0:
            grad.mul_(coefficient)
        grad = grad.to(self.masters[index].device, non_blocking=True)  # offload: into pinned host memory
        if landed:
            self._copies_landed()
        return grad

    def _copies_landed(self) -> None:
        """The host waits for the copies it issued between the accelerator and offloaded masters (the
        gradients coming down, the stepped values going up): before the step reads or rewrites masters."""
        device = module_device(self.module)
        if self.master_device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _global_sum(self, value: torch.Tensor, op=torch.distributed.ReduceOp.SUM, over_dp: bool = True) -> None:
        if over_dp:
            comm.all_reduce(value, self.dp, op=op)
        if self.model_parallel.model_parallel is not None:
            comm.all_reduce(value, self.model_parallel.model_parallel, op=op)

    def _global_norm(self, tensors: list[torch.Tensor], scale: float, device: torch.device) -> float:
        """L2 norm over the whole model of ``tensors`` (one per slot, laid out as its segments), divided by
        ``scale``: each parameter once, wherever its chunks live (fp32 one segment at a time)."""
        tp_rank = self.model_parallel.tp.rank if self.model_parallel.tp is not None else 0
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for slot, tensor in zip(self.slots, tensors):
            for param, offset, length in slot.segments:
                if counts_once_here(param, tp_rank):
                    segment = tensor[offset:offset + length].float().to(device)
                    total += (segment / scale if scale != 1.0 else segment).pow(2).sum()
        self._global_sum(total, over_dp=self.stage > 0)  # stage 0: every dp rank holds the same sum
        return total.sqrt().item()

    def parameter_norm(self) -> float:
        """L2 norm of the fp32 master weights over the whole model (Megatron's --log-params-norm); a
        collective over data and model parallelism."""
        with self.states_in_memory():
            return self._global_norm([master.data for master in self.masters], 1.0, module_device(self.module))

    def step(self) -> StepResult:
        scale = self.loss_scale
        self.wait_for_parameters()  # of modules that did not run since the last step
        self.grad_sync.finish()
        if self.units is not None:
            self.units.finish()
        grads = [slot.grad() for slot in self.slots]  # reduced, in compute precision, still scaled
        device = grads[0].device if grads else torch.device("cpu")
        overflow = torch.zeros(1, dtype=torch.float32, device=device)
        if isinstance(self.loss_scaler, DynamicLossScaler):  # decided on the device: no host read per shard
            for grad in grads:
                overflow = torch.maximum(overflow, torch.isfinite(grad).all().logical_not().float())
            self._global_sum(overflow, op=torch.distributed.ReduceOp.MAX)
        norm = self._global_norm(grads, scale, device)  # of the unscaled gradients
        skipped = bool(overflow.item()) or not math.isfinite(norm)
        self.loss_scaler.update(skipped)
        if skipped:
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
        coefficient = self.clip_grad / (norm + 1e-6) if 0 < self.clip_grad < norm else 1.0
        if self.swapped is not None:  # a swapped master's buffer is reused right after: copies land at once
            self.swapped.step(lambda index: self._master_grad(index, scale, coefficient),
                              lambda index: self._write_back(index, blocking=True))
        else:
            for index, master in enumerate(self.masters):
                master.grad = self._master_grad(index, scale, coefficient, landed=False)
            self._copies_landed()  # every gradient is down (and the last step's values are up)
            self.optimizer.step()
            for index, master in enumerate(self.masters):
                master.grad = None
                self._write_back(index)  # up to the accelerator behind the step's remaining work
        if self.units is not None:
            self.units.flush()
        if self.stage > 0:
            self._gather_parameters(overlap=self.overlap_param_gather and self.stage < 3)
        return StepResult(grad_norm=norm, loss_scale=scale)

    def _write_back(self, index: int, blocking: bool = False) -> None:
        """Master ``index`` was stepped: copy it into its compute-precision parameters (unless they are one).
        From pinned host memory the copy is asynchronous unless ``blocking``; the next step's
        ``_copies_landed`` orders it before the host rewrites the master."""
        slot = self.slots[index]
        if slot.master.data_ptr() == slot.data.data_ptr():
            return
        if slot.store is not None:
            slot.store(slot.master.data, not blocking)
        else:
            slot.data.copy_(slot.master.data, non_blocking=not blocking)

    def _gather_parameters(self, overlap: bool = False) -> None:
        """Every rank updated its chunks: all-gather each bucket of the whole-kept parameters in place
        (stage-3 units are gathered when their module next runs). With ``overlap`` the gathers are left in
        flight, the buckets the first layers need first, and each module waits for its own before its
        forward (``_wait_in_forward``)."""
        self.wait_for_parameters()
        for index, buffer in reversed(list(enumerate(self.buffers))):
            for bucket in reversed(buffer.buckets):
                low, high = bucket.chunk_range(self.shard)
                self._pending_gathers[index, bucket.index] = comm.all_gather_into_tensor(
                    buffer.data[bucket.start:bucket.end], buffer.data[low:high], self.dp, async_op=True)
        if not overlap:
            self.wait_for_parameters()

    def wait_for_parameters(self, keys=None) -> None:
        """Finish the parameter all-gathers in flight (those of ``keys`` only, if given)."""
        for key in list(self._pending_gathers) if keys is None else keys:
            handle = self._pending_gathers.pop(key, None)
            if handle is not None:
                handle.wait()

    def _wait_in_forward(self) -> list:
        """Forward pre-hooks: a module waits for the buckets that hold its own parameters (Megatron's
        --overlap-param-gather). A parameter must be read in its own module's forward, as every layer here is."""
        bucket_of = {param: (index, bucket.index) for index, buffer in enumerate(self.buffers)
                     for bucket in buffer.buckets for param in bucket.params}
        hooks = []
        for module in self.module.modules():
            keys = sorted({bucket_of[p] for p in module.parameters(recurse=False) if p in bucket_of})
            if keys:
                hooks.append(module.register_forward_pre_hook(
                    lambda module, args, keys=keys: self.wait_for_parameters(keys)))
        return hooks

    def master_pieces(self) -> list[MasterPiece]:
        """Where every parameter's elements sit in this rank's masters. Checkpoints record it, so that
        another layout can re-cut the masters and states by parameter."""
        state_index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        pieces = []
        for index, slot in enumerate(self.slots):
            first = self.shard * slot.data.numel() if slot.sharded else 0  # where the master starts in its range
            where = {id(param): (offset, shape) for param, offset, shape in slot.layout}
            for param, offset, length in slot.segments:
                start, shape = where[id(param)]
                pieces.append(MasterPiece(index, state_index[id(slot.master)], param, shape, first + offset - start,
                                          offset, length))
        return pieces

    def masters_to_parameters(self) -> None:
        """Copy every master into its compute-precision parameters on every rank (after a checkpoint
        wrote the masters)."""
        for index in range(len(self.slots)):
            self._write_back(index, blocking=True)  # swapped masters leave memory after the load
        if self.units is not None:
            self.units.flush()
        if self.stage > 0:
            self._gather_parameters()

    def gathered_parameters(self) -> contextlib.AbstractContextManager:
        """Inside this block every parameter holds its full value (stage 3 gathers them; a no-op before)."""
        self.wait_for_parameters()
        return self.units.gathered() if self.units is not None else contextlib.nullcontext()

    def states_in_memory(self) -> contextlib.AbstractContextManager:
        """Inside this block the masters, optimizer states and stage-3 shards are in memory (NVMe offload
        reads them all, and writes them back after: a checkpoint save or load runs inside it)."""
        self.wait_for_parameters()  # a checkpoint reads them
        stack = contextlib.ExitStack()
        if self.swapped is not None:
            stack.enter_context(self.swapped.in_memory())
        if self.units is not None:
            stack.enter_context(self.units.shards_in_memory())
        return stack

    def close(self) -> None:
        """Remove the swap files (NVMe offload); the optimizer cannot step after this."""
        if self.swapped is not None:
            self._close_swap()
        if self.units is not None and self.units.space is not None:
            self._close_param_swap()

    def offloaded_bytes(self) -> int:
        """Bytes of model states held in swap files."""
        spaces = [self.swapped.space if self.swapped is not None else None,
                  self.units.space if self.units is not None else None]
        return sum(space.bytes for space in spaces if space is not None)

    def state_dict(self) -> dict:
        """Everything this rank's optimizer owns, in this layout: the compute-precision parameters it holds
        (flat buffers, stage-3 shards), the fp32 masters, the torch optimizer's state and the loss scaler.
        Call it inside ``states_in_memory()`` under NVMe offload. Another layout re-cuts it by parameter
        (``master_pieces``, ``pretrain.reshard``)."""
        self.wait_for_parameters()
        return {"buffers": [buffer.data for buffer in self.buffers],
                "unit_shards": {str(dtype): shard for dtype, shard in (self.units.shards.items() if self.units
                                                                         else [])},
                "masters": [master.data for master in self.masters],
                "optimizer": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned in the same layout (ValueError if the shapes differ)."""
        targets = [b.data for b in self.buffers] + [m.data for m in self.masters]
        sources = list(state["buffers"]) + list(state["masters"])
        if self.units is not None:
            targets += list(self.units.shards.values())
            sources += [state["unit_shards"][str(dtype)] for dtype in self.units.shards]
        if len(targets) != len(sources) or any(t.shape != s.shape for t, s in zip(targets, sources)):
            raise ValueError("its tensors do not match this model's shapes (another model or layout?)")
        self.wait_for_parameters()
        with torch.no_grad():
            for target, source in zip(targets, sources):
                target.copy_(source)
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    def model_state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients, master copies and optimizer states (measured;
        stage-3 parameters count as their shards: gathered copies are transient)."""
        tensors = [b.data for b in self.buffers] + [b.grad for b in self.buffers if b.grad is not None]
        tensors += list(self.grad_sync.grad_shards or []) + [m.data for m in self.masters]
        if self.units is not None:
            tensors += list(self.units.shards.values()) + list(self.units.grad_shards.values())
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if is_per_element(t)]
        swap_buffers = self.swapped.resident_bytes if self.swapped is not None else 0
        return storage_bytes(tensors) + swap_buffers + sum(t.numel() * t.element_size()
                                                           for s in self.optimizer.state.values()
                                                           for t in s.values()
                                                           if torch.is_tensor(t) and not is_per_element(t))
