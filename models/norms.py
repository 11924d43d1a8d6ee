"""The norm layers of the GPT: LayerNorm or RMSNorm, optionally with weights stored as offsets from 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from parallel.tensor.layers import mark_sequence_parallel, with_init


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, computed in fp32 at least whatever x's dtype, keeping only x and the per-row
    1 / rms for backward (as fused kernels do; torch's composite rms_norm also keeps the normalised x,
    and an fp32 copy of a bf16 input)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        wide = torch.promote_types(x.dtype, torch.float32)
        inverse_rms = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        return (x.to(wide) * inverse_rms * weight.to(wide)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, inverse_rms = ctx.saved_tensors
        wide = inverse_rms.dtype
        normalised = x.to(wide) * inverse_rms
        grad = grad_out.to(wide)
        grad_weight = (grad * normalised).reshape(-1, x.shape[-1]).sum(0)
        grad_normalised = grad * weight.to(wide)
        grad_x = inverse_rms * (grad_normalised
                                - normalised * (grad_normalised * normalised).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight) over the last dimension.

    Owns its weight (and bias). With ``one_plus`` (Megatron's --apply-layernorm-1p) the weight is kept
    as its offset from 1 and starts at 0, so weight decay pulls the scale towards 1, not 0. Never
    communicates: a replica whose gradient is partial over tensor parallelism is only marked as such.
    """

    def __init__(self, kind: str, size: int, eps: float, one_plus: bool = False):
        super().__init__()
        self.kind, self.size, self.eps, self.one_plus = kind, size, eps, one_plus
        start = 0.0 if one_plus else 1.0
        self.weight = with_init(nn.Parameter(torch.full((size,), start)), lambda: torch.full((size,), start))
        self.bias = with_init(nn.Parameter(torch.zeros(size)), lambda: torch.zeros(size)) \
            if kind == "LayerNorm" else None

    def scale(self) -> torch.Tensor:
        """The factor the normalised input is multiplied by."""
        return self.weight + 1 if self.one_plus else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (self.size,), self.scale(), self.bias, self.eps)
        return _RMSNorm.apply(x, self.scale(), self.eps)


def build_norm(config: GPTConfig, size: int, partial_gradient: bool) -> Norm:
    """The configured norm over ``size`` channels. ``partial_gradient``: each tensor-parallel rank sees
    only part of what it normalises (a sequence shard, or its own attention heads), so its gradient
    must be summed over the tp group."""
    norm = Norm(config.normalization, size, config.layernorm_epsilon, config.apply_layernorm_1p)
    for param in norm.parameters():
        mark_sequence_parallel(param, partial_gradient)
    return norm
