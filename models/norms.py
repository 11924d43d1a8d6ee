"""The norm layers of the GPT: LayerNorm or RMSNorm, optionally with weights stored as offsets from 1,
over channels a rank holds whole or (the query / key norms over a whole projection) split across tp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from parallel.comm import AxisGroup
from parallel.param_meta import declare
from parallel.tensor.layers import mark_sequence_parallel, with_init
from parallel.tensor.rms_norm import rms_norm


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight) over the last dimension.

    Owns its weight (and bias). With ``one_plus`` (Megatron's --apply-layernorm-1p) the weight is kept
    as its offset from 1 and starts at 0, so weight decay pulls the scale towards 1, not 0. With
    ``split_over`` (RMSNorm only) the ``size`` channels are split across that tp group: the rank holds
    its slice of the weight and the norm's statistics are summed over the group. Otherwise it never
    communicates: a replica whose gradient is partial over tensor parallelism is only marked as such.
    """

    def __init__(self, kind: str, size: int, eps: float, one_plus: bool = False,
                 split_over: AxisGroup | None = None):
        super().__init__()
        self.kind, self.size, self.eps, self.one_plus = kind, size, eps, one_plus
        self.split_over = split_over if split_over is not None and split_over.size > 1 else None
        start = 0.0 if one_plus else 1.0
        parts = 1 if self.split_over is None else self.split_over.size
        self.weight = with_init(nn.Parameter(torch.full((size // parts,), start)),
                                lambda: torch.full((size // parts,), start))
        if self.split_over is not None:
            declare(self.weight, tensor_parallel=True, partition_dim=0)
        self.bias = with_init(nn.Parameter(torch.zeros(size)), lambda: torch.zeros(size)) \
            if kind == "LayerNorm" else None

    def scale(self) -> torch.Tensor:
        """The factor the normalised input is multiplied by."""
        return self.weight + 1 if self.one_plus else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (self.size,), self.scale(), self.bias, self.eps)
        return rms_norm(x, self.scale(), self.eps, self.split_over, self.size)


def build_norm(config: GPTConfig, size: int, partial_gradient: bool) -> Norm:
    """The configured norm over ``size`` channels. ``partial_gradient``: each tensor-parallel rank sees
    only part of what it normalises (a sequence shard, or its own attention heads), so its gradient
    must be summed over the tp group."""
    norm = Norm(config.normalization, size, config.layernorm_epsilon, config.apply_layernorm_1p)
    for param in norm.parameters():
        mark_sequence_parallel(param, partial_gradient)
    return norm


def build_split_norm(config: GPTConfig, size: int, tp: AxisGroup) -> Norm:
    """The configured norm (RMSNorm) over ``size`` channels split evenly across ``tp``: a rank holds its
    slice of them and of the weight."""
    return Norm(config.normalization, size, config.layernorm_epsilon, config.apply_layernorm_1p, tp)
