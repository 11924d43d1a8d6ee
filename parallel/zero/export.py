"""Write the full fp32 weights of a ZeRO-sharded model part into one safetensors file, range by range.

The file's header (names, shapes, offsets) is known before any weight is gathered, so the data is
streamed: for each bucket or stage-3 unit the data-parallel ranks all-gather the fp32 master chunks,
data-parallel rank 0 writes that range's tensors and drops them. No rank ever holds more than one
range of the model at once. The result loads with ``safetensors.torch.load_file`` into the
single-process model of the same part (the whole GPT at tp = pp = 1).
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from torch import nn

from parallel.zero.optimizer import ZeroOptimizer


class StreamedSafetensors:
    """A safetensors file written piece by piece: the header (every name, dtype and shape) first, then
    each tensor's bytes as ``write`` (a whole tensor) or ``write_at`` (a run of its elements, in any order)
    is given them. Owns the open file, written to ``path + ".tmp"`` and renamed only by ``close`` once
    every declared element arrived, so a reader never sees a half-written file. Never holds more than
    what it is given."""

    DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...]]],
                 dtype: torch.dtype = torch.float32,
                 metadata: dict[str, str] | None = None):
        self.path, self.dtype = path, dtype
        self.element = torch.empty(0, dtype=dtype).element_size()
        header, offset = {"__metadata__": metadata} if metadata else {}, 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._remaining: dict[str, int] = {}
        for name, shape in entries:
            end = offset + self.element * math.prod(shape)
            header[name] = {"dtype": self.DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self._shapes[name], self._remaining[name] = tuple(shape), math.prod(shape)
            offset = end
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._data = 8 + len(encoded)
        self._offsets = {name: header[name]["data_offsets"][0] for name in self._shapes}
        self.bytes = self._data + offset
        self._handle = open(path + ".tmp", "wb")
        self._handle.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The whole of declared tensor ``name``."""
        if tuple(tensor.shape) != self._shapes.get(name):
            raise ValueError(f"expected {name} {self._shapes.get(name)}, got {tuple(tensor.shape)}")
        self.write_at(name, 0, tensor)

    def write_at(self, name: str, offset: int, values: torch.Tensor) -> None:
        """``values`` as the elements of ``name`` from ``offset`` (row-major)."""
        count = values.numel()
        if offset < 0 or offset + count > math.prod(self._shapes[name]):
            raise ValueError(f"{name}: elements {offset}..{offset + count} are outside {self._shapes[name]}")
        self._handle.seek(self._data + self._offsets[name] + offset * self.element)
        self._handle.write(memoryview(values.detach().to("cpu", self.dtype).contiguous().reshape(-1)
                                      .view(torch.uint8).numpy()))
        self._remaining[name] -= count

    def abort(self) -> None:
        """Stop on an error: close and remove the unfinished ``.tmp`` file."""
        self._handle.close()
        os.remove(self.path + ".tmp")

    def close(self) -> None:
        """Finish the file (fsynced) and give it its name; a file missing elements is left as ``.tmp``."""
        self._handle.truncate(self.bytes)
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        missing = [name for name, left in self._remaining.items() if left]
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} declared tensors were not written whole "
                             f"(first: {missing[0]}); left as {self.path}.tmp")
        os.replace(self.path + ".tmp", self.path)


def export_fp32_state_dict(module: nn.Module, optimizer: ZeroOptimizer, path: str) -> None:
    """Stream ``module``'s parameters as fp32 (from the optimizer's masters) to ``path`` (dp rank 0 writes;
    every data-parallel rank must call it). Written to ``path + ".tmp"`` and renamed when complete."""
    names = {param: name for name, param in module.named_parameters()}
    writer = None
    if optimizer.dp.rank == 0:
        writer = StreamedSafetensors(path,
                                     [(names[param], shape) for param, shape in optimizer.parameter_shapes()])
    try:
        for param, value in optimizer.whole_masters():
            if writer is not None:
                writer.write(names[param], value)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
