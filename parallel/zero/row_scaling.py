"""Rows of parameters multiplied in place under ZeRO, wherever their elements sit (fp32 masters sharded over
dp, offloaded or swapped) and then in the compute-precision parameters: a weight rescaled between steps
(QK-clip) without a gather of it."""

from __future__ import annotations

import torch
from torch import nn

from parallel.zero.chained import ChainedZeroOptimizer


def scale_rows(optimizer, factors: dict[nn.Parameter, torch.Tensor]) -> None:
    """Multiply row r of each parameter of ``factors`` (this rank's shape) by ``factors[param][r]``, in its
    masters, then publish the part's masters into its parameters (a collective over the dp group of each
    ZeRO part holding one of them: every rank of that group must pass factors for the same parameters'
    places; a part holding none is left alone)."""
    for part in optimizer.parts if isinstance(optimizer, ChainedZeroOptimizer) else [optimizer]:
        if not any(param in factors for param in part.params):
            continue
        with part.states_in_memory(), torch.no_grad():
            for piece in part.master_pieces():
                factor = factors.get(piece.param)
                if factor is None:
                    continue
                row_length = piece.shape.numel() // piece.shape[0]
                rows = torch.arange(piece.start, piece.start + piece.length) // row_length
                master = part.masters[piece.master].data[piece.offset:piece.offset + piece.length]
                master.mul_(factor[rows].to(master.device, master.dtype))
        part.masters_to_parameters()
