"""Measure the bytes autograd keeps for backward, with saved-tensor hooks.

Inside ``meter.recording()``, every tensor saved for backward is counted once per storage (views of
one storage count once; parameters and other tensors alive anyway are excluded). ``peak_bytes``
is the largest total seen since ``reset()``; call ``release()`` after each backward, when autograd
has freed what it saved.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class SavedActivationMeter:
    """Counts the storage bytes of tensors saved for backward (activations only).

    Owns the set of storages seen in the current forward and the peak. Never keeps a reference to a
    saved tensor (only storage addresses and sizes), so it does not change what memory is held.
    """

    def __init__(self, module: nn.Module | None = None):
        self._excluded = {p.untyped_storage().data_ptr() for p in module.parameters()} if module else set()
        self._seen: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in self._excluded and address not in self._seen:
            self._seen[address] = storage.nbytes()
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return tensor

    @contextlib.contextmanager
    def recording(self):
        """Count what forward passes inside this block save for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self

    def release(self) -> None:
        """Backward has run: what was saved is gone."""
        self._seen.clear()
        self.current_bytes = 0

    def reset(self) -> None:
        self.release()
        self.peak_bytes = 0
