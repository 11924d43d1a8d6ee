"""The ZeRO optimizer for stages 0-3: flat buffers or sharded units, fp32 master shards, any element-wise
optimizer or Muon (``wrapped_optimizer``), optionally offloaded to the CPU or to swap files
(ZeRO-Offload / ZeRO-Infinity).

Per flat buffer and bucket, this rank owns one chunk (stage 0: the whole bucket). The wrapped torch optimizer
sees fp32 "master" tensors of at most ``sub_group_size`` elements each, cut from the owned chunks: views of
the parameters themselves in fp32 training, fp32 copies under bf16/fp16. A step: finish the gradient
reduction, unscale (fp16), agree on overflow over all ranks, take the global norm over every axis (each
parameter counted once), clip, step the masters, write them back into the compute-precision parameters and
(stages 1-2) all-gather every bucket so all ranks hold the full updated parameters again. """

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Callable, Iterator

import torch
from torch import nn

from parallel import comm
from parallel.buffer_pool import BufferPool
from parallel.process_groups import module_device
from parallel.zero.auto_wrap import group_units
from parallel.zero.replicated_parameters import ReplicatedParameters
from parallel.zero.grad_norm import global_norm_squared
from parallel.zero.loss_scaler import ConstantLossScaler
from parallel.zero.masters import MasterPiece, MasterShards, ShardSlot
from parallel.zero.memory import sharded_at_stage_3, storage_bytes
from parallel.zero.offload import SwappedOptimizerStates, default_sub_group_size, is_per_element
from parallel.zero.sharded_parameters import ShardedParameters
from parallel.zero.step import StepResult, step_together
from parallel.zero.groups import ZeroGroups
from parallel.zero.options import ZeroOptions
from parallel.zero.wrapped_optimizer import optimizer_over_masters, state_kinds
from parallel.zero.swap import SwapSpace

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


class ZeroOptimizer:
    """Data-parallel training with ZeRO stage 0, 1, 2 or 3 (``ZeroOptions``) over ``ZeroGroups``.

    Owns the step over its storages: ``flat`` (``ReplicatedParameters``: parameters kept whole, in flat
    buffers), ``units`` (``ShardedParameters``, stage 3), ``master`` (``MasterShards``: this rank's fp32
    masters), the wrapped torch optimizer (which sees only those masters), the loss scaler and the swap
    files. It never changes which parameters a module has, and never communicates outside its groups.

    Stage 3 shards the parameters of ``unit_modules`` above the persistence threshold; smaller ones, and
    those whose gradients need a tensor/pipeline reduction first, stay whole as in stage 2. Masters are
    cut to at most ``sub_group_size`` elements, offloaded or not, so that runs with and without offload
    step the same masters bit for bit. ``backward_parts``: modules whose backward passes interleave (a
    pipeline rank's chunks); no gradient bucket spans two. ``close()`` removes the swap files.
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, options: ZeroOptions,
                 groups: ZeroGroups, *, param_groups: list[dict] | None = None, loss_scaler=None,
                 unit_modules: list[nn.Module] | None = None, buffer_pool: BufferPool | None = None,
                 backward_parts: list[nn.Module] | None = None):
        groups.check(options)
        self.module, self.options, self.groups = module, options, groups
        self.dp, self.stage, self.clip_grad = groups.shard, options.stage, options.clip_grad
        self.replicas, self.model_parallel = groups.replicas, groups.model_parallel
        self.main_grads_in_fp32 = options.main_grads_in_fp32
        self.loss_scaler = loss_scaler or ConstantLossScaler()
        dp, stage = self.dp, self.stage
        param_groups = param_groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
        self.params = [p for group in param_groups for p in group["params"]]
        device = module_device(module)
        sharded = ((lambda p: sharded_at_stage_3(p, options.persistence_threshold)) if stage == 3
                   else (lambda p: False))
        master_groups = [{"params": [], **{k: v for k, v in group.items() if k != "params"}}
                         for group in param_groups]
        self.buffer_pool = buffer_pool or BufferPool(device)
        part_of = {p: index for index, part in enumerate(backward_parts or []) for p in part.parameters()}
        self.flat = ReplicatedParameters([[p for p in group["params"] if not sharded(p)]
                                          for group in param_groups], stage, dp,
                                         options.bucket_size, device, self.grad_dtype, self.model_parallel,
                                         self.buffer_pool, options.quantized_weights, groups.gradient_levels,
                                         groups.average_over, part=lambda p: part_of.get(p, 0))
        self.units = None
        if stage == 3:
            self.units = ShardedParameters(group_units(module, unit_modules or [], param_groups, sharded), dp,
                                           self.buffer_pool, device, options.prefetch_budget, self.grad_dtype,
                                           options.quantized_weights, groups.secondary_partition,
                                           groups.gradient_levels, groups.average_over)
        shard_numel = self.flat.shard_numel() + (self.units.shard_numel() if self.units is not None else 0)
        self.sub_group_size = options.sub_group_size or default_sub_group_size(shard_numel)
        # offloaded masters, their states and the step live on the CPU (swapped to files with nvme, where
        # a sub-group holds whole masters: none is larger than one; cut so with or without offload, as
        # DeepSpeed cuts its fp32 groups, so that both runs step the same masters bit for bit)
        self.master = MasterShards(torch.device("cpu") if options.offload_optimizer != "none" else None,
                                   device, piece=self.sub_group_size)
        self.flat.add_slots(self.master, master_groups)
        if self.units is not None:
            self.units.add_slots(self.master, master_groups, dp.rank,
                                 aliasable=options.offload_param == "none")
        if options.overlap_param_gather and stage in (1, 2):
            self.flat.wait_in_forward(module)
        self.optimizer = optimizer_over_masters(self, optimizer_factory, param_groups, master_groups)
        self.swapped = None
        if options.offload_optimizer == "nvme":
            # named by the group too: a run's dense and expert optimizers swap side by side
            space = SwapSpace(options.nvme_path, f"zero-optimizer-{dp.axis}-pid{os.getpid()}")
            self._close_swap = weakref.finalize(self, space.close)  # swap files are scratch: gone with us
            resident = {i for i, slot in enumerate(self.slots) if slot.aliased}
            self.swapped = SwappedOptimizerStates(self.optimizer, self.masters, resident,
                                                  space, self.buffer_pool,
                                                  self.sub_group_size)
        if options.offload_param == "nvme":
            space = SwapSpace(options.nvme_path, f"zero-params-{dp.axis}-pid{os.getpid()}")
            self._close_param_swap = weakref.finalize(self, space.close)
            self.units.swap_out(space)

    @property
    def slots(self) -> list[ShardSlot]:
        return self.master.slots

    @property
    def masters(self) -> list[nn.Parameter]:
        return self.master.masters

    @property
    def buffers(self):
        return self.flat.buffers

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``param_dtype`` parameters are accumulated and reduced in: fp32 main
        gradients for 16-bit parameters (Megatron's default), unless ``main_grads_in_fp32`` is off."""
        return torch.float32 if self.main_grads_in_fp32 and param_dtype in (torch.bfloat16, torch.float16) \
            else param_dtype

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
        return self.flat.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the next accumulation: zero the gradient buffers and shards. torch's ``set_to_none``
        (its default) leaves every ``param.grad`` None until backward; the buffers still accumulate (the
        first gradient of a step is added into its buffer view, which ``param.grad`` becomes again).
        ``set_to_none=False`` keeps the views attached (no transient gradient per parameter)."""
        self.flat.zero_grad(set_to_none)
        if self.units is not None:
            self.units.zero()

    def _global_sum(self, value: torch.Tensor, op=torch.distributed.ReduceOp.SUM,
                    over_dp: bool = True) -> None:
        if over_dp:
            comm.all_reduce(value, self.dp, op=op)
        if self.model_parallel.model_parallel is not None:
            comm.all_reduce(value, self.model_parallel.model_parallel, op=op)

    def norm_squared(self, tensors: list[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
        """The squared norm of ``tensors`` (one per master slot) / ``scale`` over every rank holding a part
        of this optimizer's parameters (a collective over its groups), each parameter counted once."""
        tp_rank = self.model_parallel.tp.rank if self.model_parallel.tp is not None else 0
        # stage 0: every dp rank holds the same sum
        return global_norm_squared(self.slots, tensors, scale, device, tp_rank,
                                   lambda total: self._global_sum(total, over_dp=self.stage > 0))

    def master_norm_squared(self) -> torch.Tensor:
        """The squared norm of the fp32 master weights (a collective, as ``norm_squared``)."""
        with self.states_in_memory():
            return self.norm_squared([master.data for master in self.masters], 1.0,
                                     module_device(self.module))

    def parameter_norm(self) -> float:
        """L2 norm of the fp32 masters over the whole model (--log-params-norm): a collective over dp x mp."""
        return self.master_norm_squared().sqrt().item()

    def reduced_gradients(self) -> list[torch.Tensor]:
        """Finish the gradient reductions: this rank's reduced gradient per master slot, in the gradient
        dtype, still scaled by the loss scale."""
        self.flat.wait()  # the gathers of modules that did not run since the last step
        self.flat.finish()
        if self.units is not None:
            self.units.finish()
        grads = [slot.grad() for slot in self.slots]
        if self.replicas is not None:  # the shard group's sums, summed over its replicas (pre-divided by dp)
            for handle in [comm.all_reduce(grad, self.replicas, async_op=True) for grad in grads]:
                handle.wait()
            for grad in grads:
                grad.div_(self.replicas.size)
        return grads

    def overflowed(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """1 where any rank of this optimizer's groups holds a non-finite gradient, else 0 (decided on the
        device: no host read per shard)."""
        overflow = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in grads:
            overflow = torch.maximum(overflow, torch.isfinite(grad).all().logical_not().float())
        self._global_sum(overflow, op=torch.distributed.ReduceOp.MAX)
        return overflow

    def apply(self, grads: list[torch.Tensor], scale: float, coefficient: float) -> None:
        """Step the masters with ``grads`` / ``scale`` x ``coefficient`` (the clipping factor) and publish
        the new values."""
        if self.swapped is not None:  # a swapped master's buffer is reused right after: copies land at once
            self.swapped.step(lambda index: self.master.gradient(index, scale, coefficient),
                              lambda index: self.master.write_back(index, blocking=True))
        else:
            for master, grad in zip(self.masters, self.master.gradients(scale, coefficient)):
                master.grad = grad
            self.master.copies_landed()  # every gradient is down (and the last step's values are up)
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
            self.master.write_back_all()  # up to the accelerator behind the step's remaining work
        self._publish(overlap=self.options.overlap_param_gather and self.stage < 3)

    def step(self) -> StepResult:
        return step_together([self], self.loss_scaler, self.clip_grad)

    def _publish(self, overlap: bool = False) -> None:
        """The stepped values reach every rank: stage-3 shards into their files (NVMe), whole-kept buckets
        all-gathered (stages 1-3; stage-3 units are gathered when their module next runs)."""
        if self.units is not None:
            self.units.stepped()
        self.flat.gather(overlap)

    def master_pieces(self) -> list[MasterPiece]:
        """Where every parameter's elements sit in this rank's masters. Checkpoints record it, so that
        another layout can re-cut the masters and states by parameter."""
        return self.master.pieces(self.optimizer)

    def piece_state(self, piece: MasterPiece, start: int, length: int) -> tuple[dict, dict]:
        """Elements ``[start, start + length)`` of ``piece``'s parameter (within ``piece``): their master
        values and per-element optimizer states by kind ("master", "exp_avg", ...; views, not copies),
        and the parameter's scalars (Adam's step). Call it inside ``states_in_memory()`` under NVMe
        offload. The parameter all-gathers in flight after a step are not waited for: they read these
        masters (or write the same values into them) and never change them."""
        low = piece.offset + start - piece.start
        master = self.masters[piece.master]
        values = {"master": master.data[low:low + length]}
        scalars = {}
        for kind, value in self.optimizer.state.get(master, {}).items():
            if is_per_element(value):
                values[kind] = value[low:low + length]
            else:
                scalars[kind] = value
        return values, scalars

    def load_by_parameter(self, fill: Callable[[MasterPiece, str, torch.Tensor], None], kinds: list[str],
                          scalars: Callable[[MasterPiece], dict] | None = None,
                          loss_scaler: dict | None = None) -> None:
        """Fill this rank's masters and per-element optimizer states piece by piece, whatever layout they
        came from (re-cutting a checkpoint, importing weights): ``fill(piece, kind, target)`` writes
        ``piece``'s elements of ``kind`` ("master" or a state in ``kinds``, e.g. Adam's "exp_avg") into
        ``target`` (a flat view of ``piece.length`` elements); ``scalars(piece)`` returns its parameter's
        scalars (Adam's step). Without ``scalars`` the optimizer state stays as it is (fresh:
        fine-tuning). The parameters keep their values until ``masters_to_parameters()`` (a collective:
        call it once every rank knows the load is sound). Call it inside ``states_in_memory()`` under NVMe
        offload."""
        new_states: dict[int, dict] = {}
        with torch.no_grad():
            for piece in self.master_pieces():
                span = slice(piece.offset, piece.offset + piece.length)
                fill(piece, "master", self.masters[piece.master].data[span])
                for kind in state_kinds(self.optimizer, self.masters[piece.master], kinds):
                    per_master = new_states.setdefault(piece.state, {})
                    target = per_master.setdefault(kind, torch.zeros_like(self.masters[piece.master].data))
                    fill(piece, kind, target[span])
                if scalars is not None:
                    new_states.setdefault(piece.state, {}).update(
                        {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars(piece).items()})
        if scalars is not None:
            self.optimizer.load_state_dict({"state": new_states,
                                            "param_groups": self.optimizer.state_dict()["param_groups"]})
        if loss_scaler is not None:
            self.loss_scaler.load_state_dict(loss_scaler)

    def parameter_shapes(self) -> list[tuple[nn.Parameter, torch.Size]]:
        """Every parameter the masters hold, with its full shape, in the order ``whole_masters`` yields
        them."""
        return [(param, shape) for pieces in self.master.ranges() for param, _, shape in pieces[0].layout]

    def whole_masters(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Every parameter's full fp32 value from the masters, one bucket or unit at a time (its shards
        all-gathered over dp: every data-parallel rank must run this to the end)."""
        for pieces in self.master.ranges():
            first = pieces[0]
            full = torch.cat([slot.master.data.reshape(-1) for slot in pieces]) if len(pieces) > 1 \
                else first.master.data.reshape(-1)
            if first.sharded and self.dp.size > 1:
                mine, full = full, torch.empty(full.numel() * self.dp.size,
                                               dtype=torch.float32, device=full.device)
                comm.all_gather_into_tensor(full, mine.contiguous(), self.dp)
            for param, start, shape in first.layout:
                yield param, full[start:start + shape.numel()].view(shape)

    def masters_to_parameters(self) -> None:
        """Copy every master into its compute-precision parameters on every rank (after a checkpoint
        wrote the masters)."""
        for index in range(len(self.slots)):
            self.master.write_back(index, blocking=True)  # swapped masters leave memory after the load
        self._publish()

    def gathered_parameters(self) -> contextlib.AbstractContextManager:
        """Inside this block every parameter holds its full value (stage 3 gathers them; a no-op before)."""
        self.flat.wait()
        return self.units.gathered() if self.units is not None else contextlib.nullcontext()

    def states_in_memory(self) -> contextlib.AbstractContextManager:
        """Inside this block the masters, optimizer states and stage-3 shards are in memory (NVMe offload
        reads them all, and writes them back after: a checkpoint save or load runs inside it)."""
        self.flat.wait()  # a checkpoint reads them
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
        (``master_pieces``, ``pretrain.checkpoint.reshard``)."""
        self.flat.wait()
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
        self.flat.wait()
        with torch.no_grad():
            for target, source in zip(targets, sources):
                target.copy_(source)
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.units is not None:
            self.units.stepped()

    def model_state_bytes(self) -> int:
        """Bytes this rank holds for parameters, gradients, master copies and optimizer states (measured;
        stage-3 parameters count as their shards: gathered copies are transient)."""
        tensors = (self.flat.held() + [m.data for m in self.masters]
                   + (self.units.held() if self.units else []))
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if is_per_element(t)]
        swap_buffers = self.swapped.resident_bytes if self.swapped is not None else 0
        return storage_bytes(tensors) + swap_buffers + sum(t.numel() * t.element_size()
                                                           for s in self.optimizer.state.values()
                                                           for t in s.values()
                                                           if torch.is_tensor(t) and not is_per_element(t))

