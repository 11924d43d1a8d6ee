"""The ZeRO-R buffer pool: pre-allocated contiguous memory handed out again and again.

Tensors that would otherwise be allocated anew every micro-batch come from the pool:

- arenas (``view``): gradient staging for reduce-scatter takes views of a flat arena sized once from
  the configuration;
- slots (``slots``): equal-sized buffers taken and given back, for activation checkpoints (kept from
  a layer's forward to its backward), the gathers that rebuild them, NVMe-offload sub-groups and
  parameter shards read from swap files. (ZeRO-3's gathered parameters keep a storage per unit:
  autograd ties views saved in forward to it; see parallel/zero/sharded_parameters.py.)

After the first iteration none of them allocates: memory does not fragment, and the footprint is set by
the configuration (bucket size, sub-group size, micro-batches in flight), not by the model's depth.
The pool counts its allocations and records each name's high-water mark in elements.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Owns a few flat arenas, one per (name, dtype). Hands out views; never frees an arena, and never
    hands out overlapping views of one slot while the caller still uses the previous one (callers
    choose the slot)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._arenas: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._slots: dict[tuple, SlotPool] = {}
        self.high_water: dict[str, int] = {}
        self.in_use: dict[str, int] = {}  # slot elements taken now, per name
        self.allocations = 0

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """A new buffer owned by the pool (every allocation the pool makes goes through here)."""
        self.allocations += 1
        device = torch.device(device or self.device)
        # host buffers that feed an accelerator are pinned, so copies to and from it can overlap
        return torch.empty(numel, dtype=dtype, device=device,
                           pin_memory=device.type == "cpu" and self.device.type != "cpu")

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Make arena ``name`` at least ``numel`` elements (allocates only when it must grow)."""
        key = (name, dtype)
        arena = self._arenas.get(key)
        if arena is None or arena.numel() < numel:
            self._arenas[key] = self.allocate(numel, dtype)

    def view(self, name: str, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements [start, start + numel) of arena ``name``; grows the arena if it is too small."""
        self.reserve(name, start + numel, dtype)
        self.high_water[name] = max(self.high_water.get(name, 0), start + numel)
        return self._arenas[(name, dtype)][start:start + numel]

    def slots(self, name: str, numel: int, dtype: torch.dtype,
              device: torch.device | None = None) -> SlotPool:
        """The slots of ``numel`` elements under ``name`` (one free list per size, dtype and device)."""
        device = torch.device(device or self.device)
        key = (name, numel, dtype, device)
        if key not in self._slots:
            self._slots[key] = SlotPool(self, name, numel, dtype, device)
        return self._slots[key]

    def bytes(self) -> int:
        return (sum(a.numel() * a.element_size() for a in self._arenas.values())
                + sum(s.bytes() for s in self._slots.values()))


class SlotPool:
    """A free list of equal buffers of ``numel`` elements. ``take`` reuses a returned buffer and allocates
    only when every buffer is taken, so the pool holds as many as were ever alive at once; it never frees
    one. The pool's high-water mark for ``name`` counts the elements taken at the peak, over all sizes."""

    def __init__(self, pool: BufferPool, name: str, numel: int, dtype: torch.dtype, device: torch.device):
        self.pool, self.name, self.numel, self.dtype, self.device = pool, name, numel, dtype, device
        self._free: list[torch.Tensor] = []
        self.count = 0

    def take(self) -> torch.Tensor:
        if not self._free:
            self._free.append(self.pool.allocate(self.numel, self.dtype, self.device))
            self.count += 1
        in_use = self.pool.in_use
        in_use[self.name] = in_use.get(self.name, 0) + self.numel
        self.pool.high_water[self.name] = max(self.pool.high_water.get(self.name, 0), in_use[self.name])
        return self._free.pop()

    def give_back(self, buffer: torch.Tensor) -> None:
        self.pool.in_use[self.name] -= self.numel
        self._free.append(buffer)

    def bytes(self) -> int:
        return self.count * self.numel * torch.empty(0, dtype=self.dtype).element_size()


class StagingRing:
    """``slots`` equal slots of one pool arena, used in turn. Taking a slot first finishes the work
    registered on its previous use (e.g. a reduce-scatter still reading it), so a slot is never
    overwritten while in flight; a slot its taker still holds open is skipped."""

    def __init__(self, pool: BufferPool, name: str, slot_numel: int, dtype: torch.dtype, slots: int = 2):
        self.pool, self.name, self.slot_numel, self.dtype = pool, name, slot_numel, dtype
        pool.reserve(name, slot_numel * slots, dtype)
        self._pending: list = [None] * slots
        self._next = 0

    def take(self, numel: int, finish: callable,
             avoid: set[int] = frozenset()) -> tuple[torch.Tensor, int] | None:
        """(a view of ``numel`` elements of the next slot not in ``avoid``, its index), or None when every
        slot is avoided; ``finish`` is called before the slot's next use."""
        if numel > self.slot_numel:
            raise ValueError(f"staging slot of {self.slot_numel} elements cannot hold {numel}")
        slots = len(self._pending)
        free = [(self._next + i) % slots for i in range(slots) if (self._next + i) % slots not in avoid]
        if not free:
            return None
        slot = free[0]
        self._next = (slot + 1) % slots
        if self._pending[slot] is not None:
            self._pending[slot]()
        self._pending[slot] = finish
        return self.pool.view(self.name, slot * self.slot_numel, numel, self.dtype), slot

    def drain(self) -> None:
        """Finish the work on every slot, oldest first."""
        slots = len(self._pending)
        for slot in ((self._next + i) % slots for i in range(slots)):
            if self._pending[slot] is not None:
                self._pending[slot]()
        self._pending = [None] * slots
