"""Measure the bytes autograd keeps for backward, with saved-tensor hooks.

Inside ``meter.recording(key)``, every tensor saved for backward is counted once per storage (views
of one storage count once; parameters and views of them are excluded, wherever their storage is at the
moment, e.g. a ZeRO-3 gather slot) under ``key`` (e.g. a micro-batch). ``release(key)``
drops what that key saved once its backward has run. ``peak_bytes`` is the largest total held at once
since ``reset()``: with a pipeline schedule several micro-batches are alive together.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_RECORDING: list[SavedActivationMeter] = []  # the meters whose ``recording`` block is open, innermost last


def drop_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s storage while autograd still holds the tensor (its owner rebuilds the values before
    backward reads them: ``parallel.recompute``), and take its bytes off every meter recording now."""
    storage = tensor.untyped_storage()
    for meter in _RECORDING:
        meter.dropped(storage.data_ptr())
    storage.resize_(0)


class SavedActivationMeter:
    """Counts the storage bytes of tensors saved for backward (activations only), per key.

    Owns storage addresses and sizes only: it never keeps a reference to a saved tensor, so it does
    not change what memory is held.
    """

    def __init__(self):
        self._by_key: dict[object, dict[int, int]] = {}
        self._key: object = None
        self.current_bytes = 0
        self.peak_bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter):
            return tensor  # a weight (or its transpose) kept for the backward of a matmul or norm
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        seen = self._by_key.setdefault(self._key, {})
        if address not in seen:
            seen[address] = storage.nbytes()
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return tensor

    @contextlib.contextmanager
    def recording(self, key: object = None):
        """Count what forward passes inside this block save for backward, under ``key``."""
        previous, self._key = self._key, key
        _RECORDING.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            _RECORDING.remove(self)
            self._key = previous

    def dropped(self, address: int) -> None:
        """The storage at ``address`` that the current key saved was freed (``drop_storage``)."""
        seen = self._by_key.get(self._key, {})
        self.current_bytes -= seen.get(address, 0)
        if address in seen:
            seen[address] = 0

    def hold(self, key: object, storages: dict[int, int]) -> None:
        """Count ``storages`` (address: bytes) as held under ``key`` until its ``release`` (what a split
        backward keeps for its weight pass)."""
        self._by_key[key] = dict(storages)
        self.current_bytes += sum(storages.values())
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def release(self, key: object = None) -> None:
        """The backward of ``key`` has run: what it saved is gone."""
        self.current_bytes -= sum(self._by_key.pop(key, {}).values())

    def reset(self) -> None:
        self._by_key.clear()
        self.current_bytes = 0
        self.peak_bytes = 0
