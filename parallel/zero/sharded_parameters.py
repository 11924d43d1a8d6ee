"""ZeRO stage 3: parameters stored as shards, gathered per module on demand and freed after use.

Each unit is the large parameters of one module (one dtype, one optimizer group), padded to a multiple
of the data-parallel size; rank r keeps chunk r. The full parameters live in one flat tensor per unit
whose storage is resized to zero when freed and back when gathered: the parameters (and the tensors
autograd saved for backward, which are views of the same storage, e.g. a linear layer's transposed
weight) see the gathered values again without being re-created. This is why the gathers do not come
from the buffer pool's shared slots: a view saved in forward is tied to its storage, and a shared
slot could hold another unit by the time backward reads it. Around each unit module:

    before forward      gather (or wait for the prefetched gather)
    after forward       free (unless the prefetcher would gather it right back: the end of forward), and
                        hook the outputs so that backward gathers again first
    after its backward  stage the gradients, free them, reduce-scatter into the gradient shard, free

The order in which units are gathered is recorded on the first step, checked identical on every
data-parallel rank as it happens (a mismatch raises naming both modules instead of hanging), and used
on later steps to prefetch the next units while the current one computes, within a budget of live
parameter elements. With the shards in swap files (``swap_out``, ZeRO-Infinity) each gather reads its
shard from the file into a pool slot, and the next units' shards are read ahead in the recorded order.

With a secondary partition (ZeRO++'s hpZ, ``secondary`` a group of K data-parallel ranks within a node)
each rank also keeps 1/K of every unit's gathered values: a gather from the primary shards (over all of
dp, across nodes) leaves its copy there, and every later gather until the next step (backward's, the
next micro-batches') collects the unit from the secondary shards over the K ranks alone. The secondary
values are the primary gather's output, so they are the same numbers (dequantized ones under qwZ).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from parallel import comm
from parallel.buffer_pool import BufferPool, SlotPool
from parallel.comm import AxisGroup
from parallel.quantization import weight_all_gather
from parallel.zero.flat_parameter_buffer import pieces_within
from parallel.zero.masters import MasterShards
from parallel.zero.parameter_unit import ParameterUnit, default_prefetch_budget
from parallel.zero.shard_reduce_scatter import ShardReduceScatter
from parallel.zero.swap import SwapSpace


class ShardedParameters:
    """Owns the units, their shards, secondary shards (hpZ) and gradient shards, and the gather / free /
    reduce machinery (the primary gathers sent as block-wise int8 with ``quantized_weights``, the gradient
    reductions with ``quantized_gradients``, ``parallel.quantization``).

    ``shards[dtype]`` and ``grad_shards[dtype]`` hold this rank's chunks of every unit of that dtype
    back to back. Never steps an optimizer; never keeps a full parameter alive beyond its module's
    forward or backward (plus prefetched units within ``prefetch_budget`` elements).
    """

    def __init__(self, units: list[tuple[str, nn.Module, list[nn.Parameter], int]], dp: AxisGroup,
                 pool: BufferPool, device: torch.device, prefetch_budget: int | None = 0,
                 grad_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: dtype,
                 quantized_weights: bool = False, secondary: AxisGroup | None = None,
                 quantized_gradients: list[AxisGroup] | None = None, divisor: int | None = None):
        self.dp, self.pool = dp, pool
        # hpZ: the group of the secondary partition (None: every gather is over dp)
        self.secondary = secondary if secondary is not None and 1 < secondary.size < dp.size else None
        # the shard is the gather's source, never its output: it stays exact (and may be the master)
        self._all_gather = weight_all_gather(quantized_weights)
        self.space: SwapSpace | None = None  # the shards' swap files (--offload-param nvme)
        self._reads: dict[int, tuple[SlotPool, torch.Tensor, Future]] = {}
        self._stores: list[Future] = []
        self._shards_resident = False  # swapped shards read back in (a checkpoint is saved or loaded)
        self.units = [ParameterUnit(i, name, module, params, group, dp, device)
                      for i, (name, module, params, group) in enumerate(units)]
        self.prefetch_budget = default_prefetch_budget(self.units) if prefetch_budget is None \
            else prefetch_budget
        self.shards: dict[torch.dtype, torch.Tensor] = {}
        self.grad_shards: dict[torch.dtype, torch.Tensor] = {}
        self.secondary_shards: dict[torch.dtype, torch.Tensor] = {}
        self.chunk_offset: dict[int, int] = {}
        self.secondary_offset: dict[int, int] = {}
        for dtype in {u.dtype for u in self.units}:
            members = [u for u in self.units if u.dtype == dtype]
            self.shards[dtype] = torch.empty(sum(u.chunk for u in members), dtype=dtype, device=device)
            self.grad_shards[dtype] = torch.zeros(self.shards[dtype].numel(),
                                                  dtype=grad_dtype(dtype), device=device)
            offset = secondary_offset = 0
            for unit in members:
                self.chunk_offset[unit.index], self.secondary_offset[unit.index] = offset, secondary_offset
                offset += unit.chunk
                secondary_offset += unit.numel // self.secondary.size if self.secondary else 0
            if self.secondary is not None:
                self.secondary_shards[dtype] = torch.empty(secondary_offset, dtype=dtype, device=device)
        for unit in self.units:
            unit.shard_into(self.shard(unit), dp)
        self.order: list[int] | None = None  # recorded gather order (after the first step)
        self._recording: list[int] = []
        self._position = 0
        self.live_elements = 0
        self.max_live_elements = 0
        self._unit_of = {param: unit for unit in self.units for param in unit.params}
        self._hooks: list[RemovableHandle] = []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._before_forward(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._after_forward(unit)))
            for param in unit.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._staging = {dtype: ShardReduceScatter(pool, f"zero3-staging-{dtype}",  # in the gradient dtype
                                                    max(u.numel for u in self.units if u.dtype == dtype),
                                                    grad_dtype(dtype), dp, quantized_gradients, divisor)
                         for dtype in {u.dtype for u in self.units}}

    def shard_numel(self) -> int:
        """Elements of this rank's shards of every unit."""
        return sum(unit.chunk for unit in self.units)

    def add_slots(self, masters: MasterShards, master_groups: list[dict], shard: int,
                  aliasable: bool) -> None:
        """Master slots over each unit's shard on this rank, cut to the masters' largest size
        (``aliasable`` False: shards that will live in a swap file cannot be the masters)."""
        for unit in self.units:
            ranges = [(p, unit.offsets[p], unit.offsets[p] + unit.size(p)) for p in unit.params]
            masters.add(master_groups[unit.group], self.shard(unit), lambda u=unit: self.grad_shard(u),
                        pieces_within(ranges, shard * unit.chunk, (shard + 1) * unit.chunk),
                        [(p, unit.offsets[p], unit.shapes[p]) for p in unit.params], sharded=True,
                        start=shard * unit.chunk,
                        store=lambda values, non_blocking, offset,
                        u=unit: self.store(u, values, non_blocking, offset),
                        aliasable=aliasable)

    def held(self) -> list[torch.Tensor]:
        """The shards, secondary shards and gradient shards (for the byte count; gathered parameters are
        transient)."""
        return (list(self.shards.values()) + list(self.secondary_shards.values())
                + list(self.grad_shards.values()))

    def shard(self, unit: ParameterUnit) -> torch.Tensor:
        offset = self.chunk_offset[unit.index]
        return self.shards[unit.dtype][offset:offset + unit.chunk]

    # shards in swap files ---------------------------------------------------------------------------------
    def swap_out(self, space: SwapSpace) -> None:
        """Move the shards into files of ``space`` (one per dtype); from now on a unit's shard is read
        ahead of its gather, and ``store`` writes the stepped values. The shard tensors keep their shape
        but lose their storage."""
        self.space = space
        for dtype, shard in self.shards.items():
            space.write(f"shards-{dtype}", shard.cpu()).result()  # swap files take host memory
            shard.untyped_storage().resize_(0)

    def _read(self, unit: ParameterUnit) -> None:
        """Start reading ``unit``'s shard from its file into a host pool slot (once)."""
        if unit.index not in self._reads:
            slots = self.pool.slots(f"zero3-shard-reads-{unit.dtype}", unit.chunk, unit.dtype,
                                    torch.device("cpu"))
            buffer = slots.take()
            offset = self.chunk_offset[unit.index] * buffer.element_size()
            self._reads[unit.index] = (slots, buffer, self.space.read(f"shards-{unit.dtype}", buffer, offset))

    def _source(self, unit: ParameterUnit) -> torch.Tensor:
        """This rank's shard of ``unit`` in memory: its slice of the shards, or its read from the file."""
        if self.space is None:
            return self.shard(unit)
        self._read(unit)
        slots, buffer, future = self._reads.pop(unit.index)
        future.result()
        # on an accelerator, an asynchronous device copy from the pinned slot (the collective reads device
        # memory); the slot is given back once that copy (or, on the CPU, the gather reading it) is done
        on_device = buffer.to(unit.device, non_blocking=True)
        copied = None
        if unit.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(unit.device))
        unit.source = (slots, buffer, copied)
        return on_device

    def _read_ahead(self, position: int, count: int = 2) -> None:
        """Start reading the shards of the next ``count`` units in the recorded order."""
        for index in (self.order or [])[position:position + count]:
            if not (self.units[index].gathered or self.units[index].handle is not None):
                self._read(self.units[index])

    def store(self, unit: ParameterUnit, values: torch.Tensor, non_blocking: bool = False,
              offset: int = 0) -> None:
        """The optimizer stepped elements ``offset`` on of ``unit``'s shard: keep ``values`` (cast to the
        unit's dtype) there (asynchronously from pinned host memory if ``non_blocking``: the caller orders
        its next write)."""
        if self.space is None or self._shards_resident:
            self.shard(unit)[offset:offset + values.numel()].copy_(values, non_blocking=non_blocking)
            return
        # a host copy: ``values`` may be a buffer reused before the write ends
        cast = values.to("cpu", unit.dtype, copy=True)
        position = (self.chunk_offset[unit.index] + offset) * cast.element_size()
        self._stores.append(self.space.write(f"shards-{unit.dtype}", cast, position))

    def flush(self) -> None:
        """Wait until every stored shard is in its file; reads started before the stores are stale."""
        for future in self._stores:
            future.result()
        self._stores.clear()
        for slots, buffer, future in self._reads.values():
            future.result()
            slots.give_back(buffer)
        self._reads.clear()

    @contextlib.contextmanager
    def shards_in_memory(self):
        """The shards in memory inside the block (to save or load a checkpoint), back in the files after."""
        if self.space is None:
            yield
            return
        self.flush()
        for dtype, shard in self.shards.items():
            host = torch.empty(shard.numel(), dtype=dtype)
            self.space.read(f"shards-{dtype}", host).result()
            shard.untyped_storage().resize_(shard.numel() * shard.element_size())
            shard.copy_(host)
        self._shards_resident = True  # ``store`` writes into them, and they go back to the files after
        try:
            yield
        finally:
            self._shards_resident = False
            self.swap_out(self.space)

    def secondary_shard(self, unit: ParameterUnit) -> torch.Tensor:
        """This rank's chunk of ``unit`` in the secondary partition (hpZ)."""
        size = unit.numel // self.secondary.size
        offset = self.secondary_offset[unit.index]
        return self.secondary_shards[unit.dtype][offset:offset + size]

    def stepped(self) -> None:
        """The shards took new values (a step, a load): wait for their files (NVMe) and forget the
        secondary copies, so that each unit's next gather is from the primary shards again."""
        self.flush()
        for unit in self.units:
            unit.secondary_valid = False

    def grad_shard(self, unit: ParameterUnit) -> torch.Tensor:
        offset = self.chunk_offset[unit.index]
        return self.grad_shards[unit.dtype][offset:offset + unit.chunk]

    # gathering -------------------------------------------------------------------------------------------
    def _start_gather(self, unit: ParameterUnit) -> None:
        if unit.gathered or unit.handle is not None:
            return
        full = unit.materialize()
        if unit.secondary_valid:
            unit.handle = comm.all_gather_into_tensor(full, self.secondary_shard(unit),
                                                      self.secondary, async_op=True)
        else:
            unit.handle = self._all_gather(full, self._source(unit), self.dp, async_op=True)
            unit.refresh_secondary = self.secondary is not None
        self.live_elements += unit.numel
        self.max_live_elements = max(self.max_live_elements, self.live_elements)

    def _check_order(self, unit: ParameterUnit) -> None:
        """First step: every rank must gather the same unit now, or the collectives would not pair up."""
        mine = torch.tensor([unit.index], dtype=torch.int64, device=unit.device)
        everyone = torch.empty(self.dp.size, dtype=torch.int64, device=unit.device)
        comm.all_gather_into_tensor(everyone, mine, self.dp)
        if (everyone != unit.index).any():
            other = next(i for i in everyone.tolist() if i != unit.index)
            raise RuntimeError(f"ZeRO-3 ranks diverged: this rank gathers {unit.name} while another gathers "
                               f"{self.units[other].name} (gather number {len(self._recording)}); every "
                               f"data-parallel rank must run the same modules in the same order")

    def gather(self, unit: ParameterUnit) -> None:
        """Make ``unit``'s parameters whole (waiting for a prefetch if one is in flight) and prefetch."""
        if self.order is None:
            self._check_order(unit)
            self._recording.append(unit.index)
        self._start_gather(unit)
        if (self.order is not None and self._position < len(self.order)
                and self.order[self._position] == unit.index):
            self._position += 1
            if self.space is not None:
                self._read_ahead(self._position)  # the next units' shards come off the disk
            self._prefetch()  # and their gathers run while this one computes
        self._wait(unit)

    def _wait(self, unit: ParameterUnit) -> None:
        """Finish ``unit``'s gather in flight, if any (its shard read buffer is then free again)."""
        if unit.handle is not None:
            unit.handle.wait()
            unit.handle = None
        if unit.refresh_secondary:
            size = unit.numel // self.secondary.size
            self.secondary_shard(unit).copy_(unit.full[self.secondary.rank * size:
                                                       (self.secondary.rank + 1) * size])
            unit.refresh_secondary, unit.secondary_valid = False, True
        if unit.source is not None:
            slots, buffer, copied = unit.source
            if copied is not None:
                copied.synchronize()  # the host slot is read by the device copy until then
            slots.give_back(buffer)
            unit.source = None

    def _prefetch(self) -> None:
        position, live = self._position, self.live_elements
        while position < len(self.order):
            upcoming = self.units[self.order[position]]
            if not (upcoming.gathered or upcoming.handle is not None):
                if live + upcoming.numel > self.prefetch_budget:
                    break
                self._start_gather(upcoming)
                live = self.live_elements
            position += 1

    def release(self, unit: ParameterUnit) -> None:
        self._wait(unit)
        if unit.gathered:
            unit.free()
            self.live_elements -= unit.numel

    # hooks -------------------------------------------------------------------------------------------------
    def _before_forward(self, unit: ParameterUnit):
        def hook(module, args):
            self.gather(unit)
        return hook

    def _reused_soon(self, unit: ParameterUnit) -> bool:
        """Whether the recorded order gathers ``unit`` again before the units in between outgrow the
        prefetch budget (the last units of forward, a recomputed layer): it then stays gathered. The same
        on every rank: the order and the sizes are."""
        live = self.live_elements
        for index in self.order[self._position:] if self.order is not None else []:
            between = self.units[index]
            if index != unit.index and not (between.gathered or between.handle is not None):
                live += between.numel
            if index == unit.index or live > self.prefetch_budget:
                return live <= self.prefetch_budget
        return False

    def _after_forward(self, unit: ParameterUnit):
        def hook(module, args, output):
            if not self._reused_soon(unit):
                self.release(unit)
            tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output])
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors,
                                                              lambda grads: self.gather(unit), mode="any")
            return output
        return hook

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        unit = self._unit_of[param]
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce(unit)

    def _reduce(self, unit: ParameterUnit) -> None:
        """All of ``unit``'s gradients are in: reduce-scatter them into its gradient shard, free them."""
        unit.ready = 0

        def fill(staging: torch.Tensor) -> None:
            staging.zero_()
            for param in unit.params:
                if param.grad is not None:
                    staging[unit.span(param)].copy_(param.grad.view(-1))
                    param.grad = None

        self._staging[unit.dtype].launch(unit.index, unit.numel, fill, lambda: self.grad_shard(unit))
        self.release(unit)

    def finish(self) -> None:
        """End of backward: reduce units whose gradients arrived only partly, wait for every reduction,
        and close the first step's recording."""
        for unit in self.units:
            if unit.ready > 0:
                self._reduce(unit)
        for staged in self._staging.values():
            staged.finish()
        for unit in self.units:
            self.release(unit)
        if self.order is None:
            self.order = self._recording
        self._position = 0

    @contextlib.contextmanager
    def gathered(self):
        """Every unit whole inside the block (to read or export the parameters), freed after."""
        for unit in self.units:
            self._start_gather(unit)
        for unit in self.units:
            self._wait(unit)
        try:
            yield
        finally:
            for unit in self.units:
                self.release(unit)

    def zero(self) -> None:
        for shard in self.grad_shards.values():
            shard.zero_()
        self._position = 0

