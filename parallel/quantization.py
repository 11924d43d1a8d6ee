"""Block-wise int8 quantization, and the all-gather that sends it (ZeRO++'s quantized weights, qwZ).

A flat tensor is cut into blocks of ``BLOCK`` elements (the last one zero-padded); each block is sent as
int8 values ``round(x / scale)`` in [-127, 127] with one fp32 ``scale = max|x| / 127`` (1 for an
all-zero block). Dequantized, every element is within ``scale / 2`` (half a step) of its value, before
the rounding into the output's dtype. The gather sends 1 byte per element plus 4 per block instead of
the compute dtype's 2 or 4, and every rank, the owner of a chunk included, ends with the same
dequantized values: replicas compute with identical weights. The masters the optimizer steps are
never quantized.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup

BLOCK = 256  # elements per scale: 4 / 256 = 1.6% of the int8 bytes go to scales
LEVELS = 127


def blocks(numel: int, block: int = BLOCK) -> int:
    """Blocks of ``block`` elements covering ``numel`` elements."""
    return -(-numel // block)


def quantize(values: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [blocks * block], fp32 scales [blocks]) of the flat ``values`` (any float dtype)."""
    flat = values.reshape(-1)
    count = blocks(flat.numel(), block)
    padded = torch.zeros(count * block, dtype=torch.float32, device=values.device)
    padded[:flat.numel()] = flat
    padded = padded.view(count, block)
    scales = padded.abs().amax(dim=1) / LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(padded / scales[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return quantized.view(-1), scales


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Write the values of ``quantize``'s output into the flat ``out`` (its first ``out.numel()`` elements)."""
    values = quantized.view(-1, block).to(torch.float32) * scales[:, None]
    out.view(-1).copy_(values.view(-1)[:out.numel()])
    return out


class _QuantizedGather:
    """The two gathers in flight (values, scales); ``wait`` finishes them and dequantizes every chunk."""

    def __init__(self, output, quantized, scales, handles, chunk: int, block: int):
        self.output, self.quantized, self.scales, self.handles = output, quantized, scales, handles
        self.chunk, self.block, self.done = chunk, block, False

    def wait(self) -> None:
        if self.done:
            return None
        for handle in self.handles:
            handle.wait()
        size = self.scales.numel() // blocks(self.chunk, self.block)
        rows = self.output.view(size, self.chunk)
        for rank, (values, scales) in enumerate(zip(self.quantized.view(size, -1), self.scales.view(size, -1))):
            dequantize(values, scales, rows[rank], self.block)
        self.done = True
        return None

    def is_completed(self) -> bool:
        return self.done


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group: AxisGroup, async_op: bool = False,
                         block: int = BLOCK):
    """``comm.all_gather_into_tensor`` with the values sent block-wise as int8 (this module's docstring):
    ``output`` (``group.size`` x ``input``'s elements, any float dtype) ends with every rank's dequantized
    chunk, this rank's own included; ``input`` may be ``output``'s own chunk."""
    if output.numel() != input.numel() * group.size:
        raise ValueError(f"all_gather over {group.axis} (size {group.size}): output has {output.numel()} "
                         f"elements, input {input.numel()}; output must be exactly size x input")
    quantized, scales = quantize(input, block)  # before the gather: ``input`` may be overwritten by it
    if group.size == 1:
        dequantize(quantized, scales, output, block)
        return comm.Completed() if async_op else None
    all_quantized = torch.empty(quantized.numel() * group.size, dtype=torch.int8, device=input.device)
    all_scales = torch.empty(scales.numel() * group.size, dtype=torch.float32, device=input.device)
    handles = [comm.all_gather_into_tensor(all_quantized, quantized, group, async_op=True),
               comm.all_gather_into_tensor(all_scales, scales, group, async_op=True)]
    gather = _QuantizedGather(output, all_quantized, all_scales, handles, input.numel(), block)
    return gather if async_op else gather.wait()


def weight_all_gather(quantized: bool):
    """The all-gather a ZeRO storage sends its parameters with: this module's (``--zero-quantized-weights``)
    or ``comm``'s exact one; both take ``(output, input, group, async_op=...)``."""
    return quantized_all_gather if quantized else comm.all_gather_into_tensor
