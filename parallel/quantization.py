"""Block-wise int8 quantization, and the collectives that send it: ZeRO++'s quantized weight all-gather
(qwZ) and quantized gradient reduce-scatter (qgZ).

A flat tensor is cut into blocks of ``BLOCK`` elements (the last one zero-padded); each block is sent as
int8 values ``round(x / scale)`` in [-127, 127] with one fp32 ``scale = max|x| / 127`` (1 for an
all-zero block). Dequantized, every element is within ``scale / 2`` (half a step) of its value, before
the rounding into the output's dtype. The gather sends 1 byte per element plus 4 per block instead of
the compute dtype's 2 or 4, and every rank, the owner of a chunk included, ends with the same
dequantized values: replicas compute with identical weights. The masters the optimizer steps are
never quantized.
"""

from __future__ import annotations

import math

import torch

from parallel import comm
from parallel.comm import AxisGroup

BLOCK = 256  # elements per scale: 4 / 256 = 1.6% of the int8 bytes go to scales
LEVELS = 127


def blocks(numel: int, block: int = BLOCK) -> int:
    """Blocks of ``block`` elements covering ``numel`` elements."""
    return -(-numel // block)


def pack_rows(values: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The 2-D ``values`` quantized into one int8 buffer [rows, blocks * (block + 4)]: each row's int8
    values, then the bytes of its fp32 scales, so that one collective sends both. A block holding an inf
    or a NaN gets a non-finite scale, so it dequantizes to non-finite values: an fp16 overflow stays
    visible."""
    rows, columns = values.shape
    count = blocks(columns, block)
    padded = torch.zeros(rows, count * block, dtype=torch.float32, device=values.device)
    padded[:, :columns] = values
    padded = padded.view(rows, count, block)
    packed = torch.empty(rows, count * (block + 4), dtype=torch.int8, device=values.device)
    quantized, scales = unpack_rows(packed, columns, block)
    torch.amax(padded.abs(), dim=2, out=scales).div_(LEVELS)
    scales.masked_fill_(scales == 0, 1.0)
    quantized.view(rows, count, block).copy_(torch.round(padded / scales[..., None]).clamp_(-LEVELS, LEVELS))
    return packed


def unpack_rows(packed: torch.Tensor, columns: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [rows, blocks * block], fp32 scales [rows, blocks]): views of ``pack_rows``' buffer of
    rows of ``columns`` values."""
    count = blocks(columns, block)
    packed = packed.view(packed.shape[0] if packed.dim() == 2 else -1, count * (block + 4))
    return packed[:, :count * block], packed[:, count * block:].view(torch.float32)


def dequantize_rows(packed: torch.Tensor, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Write every row of ``pack_rows``' buffer into the rows of the 2-D ``out`` (any float dtype) in one
    pass: straight into it when its rows are whole blocks, else through one fp32 temporary."""
    rows, columns = out.shape
    quantized, scales = unpack_rows(packed, columns, block)
    quantized = quantized.view(rows, -1, block)
    if columns % block == 0 and out.is_contiguous():
        torch.mul(quantized, scales[..., None], out=out.view(rows, -1, block))
    else:
        out.copy_((quantized * scales[..., None]).view(rows, -1)[:, :columns])
    return out


def quantize(values: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [blocks * block], fp32 scales [blocks]) of the flat ``values`` (any float dtype)."""
    quantized, scales = unpack_rows(pack_rows(values.reshape(1, -1), block), values.numel(), block)
    return quantized.view(-1), scales.view(-1)


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               block: int = BLOCK) -> torch.Tensor:
    """Write the values of ``quantize``'s output into the flat ``out`` (its first ``out.numel()``
    elements)."""
    values = quantized.view(-1, block).to(torch.float32) * scales.view(-1)[:, None]
    out.view(-1).copy_(values.view(-1)[:out.numel()])
    return out


class _QuantizedGather:
    """The gather of every rank's packed values and scales in flight; ``wait`` finishes it and
    dequantizes all chunks at once."""

    def __init__(self, output: torch.Tensor, gathered: torch.Tensor, handle, size: int, block: int):
        self.output, self.gathered, self.handle = output.view(size, -1), gathered, handle
        self.block, self.done = block, False

    def wait(self) -> None:
        if self.done:
            return None
        self.handle.wait()
        dequantize_rows(self.gathered.view(self.output.shape[0], -1), self.output, self.block)
        self.done = True
        return None

    def is_completed(self) -> bool:
        return self.done


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, group: AxisGroup, async_op: bool = False,
                         block: int = BLOCK):
    """``comm.all_gather_into_tensor`` with the values sent block-wise as int8 (this module's docstring),
    values and scales in one buffer: ``output`` (``group.size`` x ``input``'s elements, any float dtype)
    ends with every rank's dequantized chunk, this rank's own included; ``input`` may be ``output``'s own
    chunk."""
    if output.numel() != input.numel() * group.size:
        raise ValueError(f"all_gather over {group.axis} (size {group.size}): output has {output.numel()} "
                         f"elements, input {input.numel()}; output must be exactly size x input")
    packed = pack_rows(input.reshape(1, -1), block)  # before the gather: ``input`` may be overwritten by it
    if group.size == 1:
        dequantize_rows(packed, output.view(1, -1), block)
        return comm.Completed() if async_op else None
    gathered = torch.empty(packed.numel() * group.size, dtype=torch.int8, device=input.device)
    handle = comm.all_gather_into_tensor(gathered, packed.view(-1), group, async_op=True)
    gather = _QuantizedGather(output, gathered, handle, group.size, block)
    return gather if async_op else gather.wait()


class _HierarchicalReduceScatter:
    """A quantized reduce-scatter level by level: the first level's all-to-all is in flight from the
    start; ``advance`` finishes the level in flight, sums it in fp32 and starts the next one (the partial
    sums, quantized again, to the ranks of the next group); ``wait`` advances through the rest and adds
    the sum into the output."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, levels: list[AxisGroup], block: int):
        self.output, self.levels, self.block, self.done = output, levels, block, False
        self.chunk = output.numel()
        self.sizes = [level.size for level in levels]
        # input as [s_k-1, ..., s_1, s_0, chunk] (the innermost level varies fastest along the ranks)
        self.partial = input.reshape(*reversed(self.sizes), self.chunk)
        self.index = 0
        self.step = self._post(0)

    def _post(self, index: int):
        """Quantize each part of ``partial`` for the ranks of level ``index`` and start its all-to-all (values
        and scales in one buffer)."""
        level = self.levels[index]
        parts = self.partial.movedim(-2, 0).reshape(level.size, -1)  # row j: what level rank j sums
        packed = pack_rows(parts, self.block)
        received = torch.empty_like(packed)
        return comm.all_to_all_single(received, packed, level, async_op=True), received, parts.shape[1]

    def _finish_level(self) -> None:
        handle, received, columns = self.step
        handle.wait()
        quantized, scales = unpack_rows(received, columns, self.block)
        total = torch.zeros(columns, dtype=torch.float32, device=self.output.device)
        row = torch.empty(quantized.shape[1], dtype=torch.float32, device=self.output.device)
        for values, row_scales in zip(quantized, scales):  # one row's fp32 temporary at a time
            torch.mul(values.view(-1, self.block), row_scales[:, None], out=row.view(-1, self.block))
            total += row[:columns]
        self.partial = total.view(*reversed(self.sizes[self.index + 1:]), self.chunk)

    def advance(self) -> None:
        """Finish the level in flight and start the next, if one is left. Callers advance at the same point
        on every rank (``ShardReduceScatter`` as the next reduction starts), so that every group sees
        its collectives in one order."""
        if self.done or self.index + 1 == len(self.levels):
            return
        self._finish_level()
        self.index += 1
        self.step = self._post(self.index)

    def wait(self) -> None:
        if self.done:
            return None
        while self.index + 1 < len(self.levels):
            self.advance()
        self._finish_level()
        self.output.view(-1).add_(self.partial.view(-1).to(self.output.dtype))
        self.done = True
        return None

    def is_completed(self) -> bool:
        return self.done


def hierarchy_rank(levels: list[AxisGroup]) -> int:
    """This rank's index in the group the ``levels`` make up, the first (innermost) varying fastest."""
    index, stride = 0, 1
    for level in levels:
        index += level.rank * stride
        stride *= level.size
    return index


def quantized_reduce_scatter_add(output: torch.Tensor, input: torch.Tensor, levels: list[AxisGroup],
                                 async_op: bool = False, block: int = BLOCK):
    """ZeRO++'s quantized gradients (qgZ): add this rank's chunk of the sum of ``input`` over the ranks of
    ``levels`` (e.g. [the data-parallel ranks of a node, the ranks across nodes]; chunk i of ``input``
    belongs to ``hierarchy_rank`` i) into ``output``. Each level is an all-to-all of block-wise int8
    values with fp32 scales, intra-node first: the inter-node level sends the node's partial sums, 1/s_0 of
    the input, at a byte an element. Summed in fp32; ``input`` may be reused once this returns."""
    total = math.prod(level.size for level in levels)
    if input.numel() != output.numel() * total:
        raise ValueError("quantized reduce-scatter over "
                         f"{'x'.join(str(level.size) for level in levels)} ranks: "
                         f"input has {input.numel()} elements, output {output.numel()}")
    levels = [level for level in levels if level.size > 1]
    if not levels:
        output.view(-1).add_(input.view(-1).to(output.dtype))
        return comm.Completed() if async_op else None
    handle = _HierarchicalReduceScatter(output, input, levels, block)
    return handle if async_op else handle.wait()


def weight_all_gather(quantized: bool):
    """The all-gather a ZeRO storage sends its parameters with: this module's (``--zero-quantized-weights``)
    or ``comm``'s exact one; both take ``(output, input, group, async_op=...)``."""
    return quantized_all_gather if quantized else comm.all_gather_into_tensor
