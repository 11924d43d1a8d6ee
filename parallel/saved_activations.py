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
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            self._key = previous

    def release(self, key: object = None) -> None:
        """The backward of ``key`` has run: what it saved is gone."""
        self.current_bytes -= sum(self._by_key.pop(key, {}).values())

    def reset(self) -> None:
        self._by_key.clear()
        self.current_bytes = 0
        self.peak_bytes = 0
