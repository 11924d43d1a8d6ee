"""This rank's fp32 masters: one per shard slot, where it lives, how gradients reach it, how stepped values
leave it, and where every parameter's elements sit in it (for checkpoints in other layouts).

A slot is one contiguous piece of this rank's shard (a bucket chunk of a flat buffer, or a stage-3 unit's
shard; with ``piece`` set, at most that many elements of one: NVMe offload steps the masters a
sub-group at a time, and a sub-group cannot hold part of a master). Its master is a view of the parameters
themselves where those are fp32 and live where the masters live; otherwise an fp32 copy, in pinned host
memory when the parameters are on an accelerator and the optimizer is offloaded, so that copies to and
from it run asynchronously.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass
class ShardSlot:
    """One contiguous piece of this rank's shard: where its compute-precision values live, how to get
    its reduced gradient, its fp32 master, and which parameter elements it holds (for the norm)."""

    data: torch.Tensor
    grad: Callable[[], torch.Tensor]
    master: nn.Parameter
    segments: list[tuple[nn.Parameter, int, int]]  # (parameter, offset in this slot, length)
    # every parameter of the whole range: (param, offset, shape)
    layout: list[tuple[nn.Parameter, int, torch.Size]]
    sharded: bool  # the slot is in this rank's chunk of a range split over dp (else in the whole range)
    start: int  # where ``data`` starts in its range (the layout's coordinates)
    store: Callable[[torch.Tensor, bool], None] | None = None  # keeps stepped values (stage 3; non-blocking?)

    @property
    def aliased(self) -> bool:
        """The master is the parameters' own storage (fp32 training, masters where the parameters are)."""
        return self.master.data_ptr() == self.data.data_ptr()


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


class MasterShards:
    """Owns this rank's shard slots and their fp32 masters, and the copies between masters and parameters.

    Never steps the optimizer, never communicates, never decides how much to clip: the step hands it the
    loss scale and the clipping coefficient.
    """

    def __init__(self, master_device: torch.device | None, compute_device: torch.device,
                 piece: int | None = None):
        self.master_device, self.compute_device, self.piece = master_device, compute_device, piece
        self.slots: list[ShardSlot] = []

    @property
    def masters(self) -> list[nn.Parameter]:
        return [slot.master for slot in self.slots]

    def add(self, group: dict, data: torch.Tensor, grad: Callable[[], torch.Tensor], segments, layout,
            sharded: bool, start: int, store=None, aliasable: bool = True) -> None:
        """Slots over ``data`` (this rank's part of a range, from element ``start`` of it; ``segments``:
        (param, offset in ``data``, length)), at most ``piece`` elements each; their masters join optimizer
        ``group``. ``store(values, non_blocking, offset)`` keeps stepped values at ``offset`` of ``data``."""
        if self.piece is not None and self.piece < 1:
            raise ValueError(f"--zero-sub-group-size must be >= 1 element, got {self.piece}")
        size = self.piece or max(1, data.numel())
        for low in range(0, data.numel(), size) or [0]:
            high = min(low + size, data.numel())
            within = [(param, max(offset, low) - low, min(offset + length, high) - max(offset, low))
                      for param, offset, length in segments if offset < high and offset + length > low]
            self._add(group, data[low:high], (lambda low=low, high=high: grad()[low:high]),
                      within, layout, sharded,
                      start + low,
                      None if store is None else (lambda v, nb, low=low: store(v, nb, low)), aliasable)

    def _add(self, group: dict, data: torch.Tensor, grad: Callable[[], torch.Tensor], segments, layout,
             sharded: bool, start: int, store, aliasable: bool) -> None:
        device = self.master_device or data.device
        if aliasable and data.dtype == torch.float32 and data.device == device:
            master = nn.Parameter(data)
        else:
            pinned = device.type == "cpu" and data.device.type != "cpu"
            master = nn.Parameter(torch.empty(data.shape, dtype=torch.float32,
                                              device=device, pin_memory=pinned)
                                  .copy_(data.detach()))
        group["params"].append(master)
        self.slots.append(ShardSlot(data, grad, master, segments, layout, sharded, start, store))

    def ranges(self) -> Iterator[list[ShardSlot]]:
        """The slots of each bucket or unit, in order (a range's pieces follow each other)."""
        for _, pieces in itertools.groupby(self.slots, key=lambda slot: id(slot.layout)):
            yield list(pieces)

    def gradient(self, index: int, scale: float, coefficient: float, landed: bool = True) -> torch.Tensor:
        """Master ``index``'s fp32 gradient, unscaled (the loss ``scale`` of its backward) and clipped by
        ``coefficient``, on the master's device (in place where no conversion is needed). Made one master
        at a time when it is stepped, so that with NVMe offload only the sub-groups in flight hold an fp32
        copy. An offloaded master's gradient comes down to pinned host memory asynchronously: with
        ``landed`` False the caller must ``copies_landed()`` before the host reads it."""
        grad = self.slots[index].grad()
        grad = grad if grad.dtype == torch.float32 else grad.float()
        if scale != 1.0:
            grad.div_(scale)
        if coefficient != 1.0:
            grad.mul_(coefficient)
        grad = grad.to(self.slots[index].master.device, non_blocking=True)
        if landed:
            self.copies_landed()
        return grad

    def gradients(self, scale: float, coefficient: float) -> list[torch.Tensor]:
        """Every master's gradient as ``gradient`` makes it (the same operations, so the same values), the
        unscaling and the clipping each one multi-tensor launch per device instead of one per master. The
        copies to offloaded masters are in flight: ``copies_landed()`` before the host reads them."""
        grads = [slot.grad() for slot in self.slots]
        grads = [grad if grad.dtype == torch.float32 else grad.float() for grad in grads]
        for same_device in by_device(grads):
            if scale != 1.0:
                torch._foreach_div_(same_device, scale)
            if coefficient != 1.0:
                torch._foreach_mul_(same_device, coefficient)
        return [grad.to(slot.master.device, non_blocking=True) for grad, slot in zip(grads, self.slots)]

    def write_back_all(self) -> None:
        """``write_back`` of every master, one multi-tensor copy per pair of devices (the stage-3 ones whose
        values go to a store one at a time)."""
        pairs: dict[tuple[torch.device, torch.device], tuple[list, list]] = {}
        for index, slot in enumerate(self.slots):
            if slot.aliased:
                continue
            if slot.store is not None:
                self.write_back(index)
                continue
            targets, sources = pairs.setdefault((slot.data.device, slot.master.device), ([], []))
            targets.append(slot.data)
            sources.append(slot.master.data)
        for targets, sources in pairs.values():
            torch._foreach_copy_(targets, sources, non_blocking=True)

    def copies_landed(self) -> None:
        """The host waits for the copies it issued between the accelerator and offloaded masters (the
        gradients coming down, the stepped values going up): before the step reads or rewrites masters."""
        if self.master_device is not None and self.compute_device.type == "cuda":
            torch.cuda.current_stream(self.compute_device).synchronize()

    def write_back(self, index: int, blocking: bool = False) -> None:
        """Master ``index`` was stepped: copy it into its compute-precision parameters (unless they are one).
        From pinned host memory the copy is asynchronous unless ``blocking``; the next step's
        ``copies_landed`` orders it before the host rewrites the master."""
        slot = self.slots[index]
        if slot.aliased:
            return
        if slot.store is not None:
            slot.store(slot.master.data, not blocking)
        else:
            slot.data.copy_(slot.master.data, non_blocking=not blocking)

    def pieces(self, optimizer: torch.optim.Optimizer) -> list[MasterPiece]:
        """Where every parameter's elements sit in these masters (and which torch-optimizer state is each
        master's). Checkpoints record it, so that another layout can re-cut masters and states by
        parameter."""
        state_index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        found = []
        for index, slot in enumerate(self.slots):
            where = {id(param): (offset, shape) for param, offset, shape in slot.layout}
            for param, offset, length in slot.segments:
                start, shape = where[id(param)]
                found.append(MasterPiece(index, state_index[id(slot.master)], param, shape,
                                         slot.start + offset - start, offset, length))
        return found


def by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device (a multi-tensor launch takes one device), each group in order."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return list(groups.values())
