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
    """A safetensors file written tensor by tensor in a declared order: the header (every name, dtype and
    shape) first, then each tensor's bytes as ``write`` is given it. Owns the open file, written to
    ``path + ".tmp"`` and renamed only by ``close`` after every declared tensor arrived, so a reader never
    sees a half-written file. Never holds more than the tensor being written."""

    DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...]]],
                 dtype: torch.dtype = torch.float32,
                 metadata: dict[str, str] | None = None):
        self.path, self.dtype, self._pending = path, dtype, [(name, tuple(shape)) for name, shape in entries]
        header, offset = {"__metadata__": metadata} if metadata else {}, 0
        size = torch.empty(0, dtype=dtype).element_size()
        for name, shape in self._pending:
            end = offset + size * math.prod(shape)
            header[name] = {"dtype": self.DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._handle = open(path + ".tmp", "wb")
        self._handle.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next declared tensor (names must come in the declared order)."""
        expected, shape = self._pending.pop(0)
        if name != expected or tuple(tensor.shape) != shape:
            raise ValueError(f"expected {expected} {shape} next, got {name} {tuple(tensor.shape)}")
        self._handle.write(tensor.detach().to("cpu", self.dtype).contiguous().view(torch.uint8)
                           .numpy().tobytes())

    def abort(self) -> None:
        """Stop on an error: close and remove the unfinished ``.tmp`` file."""
        self._handle.close()
        os.remove(self.path + ".tmp")

    def close(self) -> None:
        """Finish the file (fsynced) and give it its name; a file missing tensors is left as ``.tmp``."""
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        if self._pending:
            raise ValueError(f"{self.path}: {len(self._pending)} declared tensors were never written "
                             f"(first: {self._pending[0][0]}); left as {self.path}.tmp")
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
