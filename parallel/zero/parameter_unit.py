"""One stage-3 unit: the sharded parameters of one module, and the flat tensor their full values live in
while gathered (its storage resized to zero when freed, so that views autograd saved see the values
again after the next gather). ``parallel.zero.sharded_parameters`` gathers, frees and reduces units."""

from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.buffer_pool import SlotPool
from parallel.comm import AxisGroup
from parallel.zero.flat_parameter_buffer import initial_value, point_at


class ParameterUnit:
    """The sharded parameters of one module: this rank's chunk, the flat full tensor (gathered or
    freed) and the per-parameter offsets. Never communicates by itself."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter], group: int,
                 dp: AxisGroup, device: torch.device):
        self.index, self.name, self.module, self.params, self.group = index, name, module, params, group
        self.dtype, self.device = params[0].dtype, device
        used = sum(p.numel() for p in params)
        self.numel = -(-used // dp.size) * dp.size
        self.chunk = self.numel // dp.size
        self.offsets, self.shapes, offset = {}, {}, 0
        for param in params:  # shapes are kept: a freed parameter is empty
            self.offsets[param], self.shapes[param] = offset, param.shape
            offset += param.numel()
        self.handle = None
        self.secondary_valid = False  # its secondary chunk holds the values of the current step
        self.refresh_secondary = False  # a primary gather in flight: copy the secondary chunk after it
        # a shard read from a swap file, in flight: its host slot, and the event after its copy to the device
        self.source: tuple[SlotPool, torch.Tensor, torch.cuda.Event | None] | None = None
        self.ready = 0

    def size(self, param: nn.Parameter) -> int:
        return self.shapes[param].numel()

    def span(self, param: nn.Parameter) -> slice:
        """Where ``param``'s elements sit in the unit's flat tensor."""
        return slice(self.offsets[param], self.offsets[param] + self.size(param))

    def shard_into(self, shard: torch.Tensor, dp: AxisGroup) -> None:
        """Build the unit's full values (a model on the meta device is materialised here, one unit at a
        time), keep this rank's chunk in ``shard``, then free the rest."""
        full = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for param in self.params:
            full[self.span(param)].copy_(initial_value(param).reshape(-1))
        comm.broadcast(full, src=dp.ranks[0], group=dp)  # every rank starts from dp rank 0's weights
        shard.copy_(full[dp.rank * self.chunk:(dp.rank + 1) * self.chunk])
        self.full = full
        self.views = {param: full[self.span(param)].view(self.shapes[param]) for param in self.params}
        for param in self.params:
            point_at(param, self.views[param])
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self.free()

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Drop the full values; the parameters become empty (reading one is an error, not garbage)."""
        self.full.untyped_storage().resize_(0)
        for param in self.params:
            param.data = self._placeholder

    def materialize(self) -> torch.Tensor:
        """Give the flat tensor its storage back (contents undefined until gathered) and the parameters
        their views of it."""
        self.full.untyped_storage().resize_(self.numel * self.full.element_size())
        for param in self.params:
            param.data = self.views[param]
        return self.full.data  # a fresh version counter: writing it never invalidates saved tensors


def default_prefetch_budget(units: list[ParameterUnit]) -> int:
    """Room for the modules whose units enclose others' (a model's embedding and head around its blocks:
    gathered all through its forward) and for two of the largest other modules (all of a module's units,
    one per dtype and optimizer group), so that the next one is gathered while one computes. (A fixed
    count of units would stop prefetching altogether once one block outgrows it; twice the largest unit
    would, once the enclosing one is the largest or a block holds several units.)"""
    sizes: dict[nn.Module, int] = {}
    for unit in units:
        sizes[unit.module] = sizes.get(unit.module, 0) + unit.numel
    enclosing = [module for module in sizes
                 if any(inner is not module and inner in sizes for inner in module.modules())]
    rest = [size for module, size in sizes.items() if module not in enclosing]
    return sum(sizes[module] for module in enclosing) + 2 * max(rest, default=0)
