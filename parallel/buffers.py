"""The ZeRO-R buffer pool: named, pre-allocated contiguous arenas handed out as views.

Short-lived tensors that would otherwise be allocated again every micro-batch (gradient staging for
reduce-scatter, its output chunks) take views of an arena sized once from the configuration, so after
the first iteration none of them allocates: memory does not fragment and their footprint is a
constant independent of the model's depth. The pool counts arena allocations and records each
arena's high-water mark (the largest extent handed out).
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
        self.high_water: dict[str, int] = {}
        self.allocations = 0

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Make arena ``name`` at least ``numel`` elements (allocates only when it must grow)."""
        key = (name, dtype)
        arena = self._arenas.get(key)
        if arena is None or arena.numel() < numel:
            self._arenas[key] = torch.empty(numel, dtype=dtype, device=self.device)
            self.allocations += 1

    def view(self, name: str, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements [start, start + numel) of arena ``name``; grows the arena if it is too small."""
        self.reserve(name, start + numel, dtype)
        self.high_water[name] = max(self.high_water.get(name, 0), start + numel)
        return self._arenas[(name, dtype)][start:start + numel]

    def bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._arenas.values())


class StagingRing:
    """``slots`` equal slots of one pool arena, used in turn. Taking a slot first finishes the work
    registered on its previous use (e.g. a reduce-scatter still reading it), so a slot is never
    overwritten while in flight."""

    def __init__(self, pool: BufferPool, name: str, slot_numel: int, dtype: torch.dtype, slots: int = 2):
        self.pool, self.name, self.slot_numel, self.dtype = pool, name, slot_numel, dtype
        pool.reserve(name, slot_numel * slots, dtype)
        self._pending: list = [None] * slots
        self._next = 0

    def take(self, numel: int, finish: callable) -> torch.Tensor:
        """A view of ``numel`` elements of the next slot; ``finish`` is called before the slot's next use."""
        if numel > self.slot_numel:
            raise ValueError(f"staging slot of {self.slot_numel} elements cannot hold {numel}")
        slot, self._next = self._next, (self._next + 1) % len(self._pending)
        if self._pending[slot] is not None:
            self._pending[slot]()
        self._pending[slot] = finish
        return self.pool.view(self.name, slot * self.slot_numel, numel, self.dtype)

    def drain(self) -> None:
        """Finish the work on every slot, oldest first."""
        slots = len(self._pending)
        for slot in ((self._next + i) % slots for i in range(slots)):
            if self._pending[slot] is not None:
                self._pending[slot]()
        self._pending = [None] * slots
