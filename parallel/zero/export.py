"""Write the full fp32 weights of a ZeRO-sharded model part into one safetensors file, range by range.

The file's header (names, shapes, offsets) is known before any weight is gathered, so the data is
streamed: for each bucket or stage-3 unit the data-parallel ranks all-gather the fp32 master chunks,
data-parallel rank 0 writes that range's tensors and drops them. No rank ever holds more than one
range of the model at once. The result loads with ``safetensors.torch.load_file`` into the
single-process model of the same part (the whole GPT at tp = pp = 1).
"""

from __future__ import annotations

import json
import os
import struct

import torch
from torch import nn

from parallel import comm
from parallel.zero.optimizer import ZeroOptimizer


def export_fp32_state_dict(module: nn.Module, optimizer: ZeroOptimizer, path: str) -> None:
    """Stream ``module``'s parameters as fp32 (from the optimizer's masters) to ``path`` (dp rank 0 writes;
    every data-parallel rank must call it). Written to ``path + ".tmp"`` and renamed when complete."""
    names = {param: name for name, param in module.named_parameters()}
    entries, offset = [], 0
    for slot in optimizer.slots:
        for param, _, shape in slot.layout:
            size = 4 * shape.numel()
            entries.append((names[param], shape, offset, offset + size))
            offset += size
    writer = optimizer.dp.rank == 0
    if writer:
        header = json.dumps({name: {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}
                             for name, shape, begin, end in entries}).encode()
        header += b" " * (-len(header) % 8)
        handle = open(path + ".tmp", "wb")
        handle.write(struct.pack("<Q", len(header)) + header)
    try:
        for slot in optimizer.slots:
            full = slot.master.data
            if slot.sharded and optimizer.dp.size > 1:
                full = torch.empty(full.numel() * optimizer.dp.size, dtype=torch.float32, device=full.device)
                comm.all_gather_into_tensor(full, slot.master.data.contiguous(), optimizer.dp)
            if writer:
                for param, start, shape in slot.layout:
                    handle.write(full[start:start + shape.numel()].cpu().numpy().tobytes())
    finally:
        if writer:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
    if writer:
        os.replace(path + ".tmp", path)
