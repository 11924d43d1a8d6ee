"""RMSNorm's forward and backward, over a last dimension a rank holds whole or split across the tp group.

y = x / rms(x) * w, computed in fp32 at least whatever x's dtype, keeping only x and the per-row 1 / rms
for backward (as fused kernels do; torch's composite rms_norm also keeps the normalised x, and an fp32
copy of a bf16 input). Split (OLMo 2's query / key norms, taken over every head while a rank holds
some heads' channels): the sum of squares is all-reduced over the group in forward, and the row's
sum of grad * w * normalised in backward; each rank keeps its slice of the weight and its gradient.
"""

from __future__ import annotations

import functools

import torch

from parallel import comm
from parallel.comm import AxisGroup


def _row_sum(x: torch.Tensor, group: AxisGroup | None) -> torch.Tensor:
    """Sum over the last dimension, over every rank's part of it when split."""
    total = x.sum(-1, keepdim=True)
    if group is not None:
        comm.all_reduce(total, group)
    return total


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, group, size):
        wide = torch.promote_types(x.dtype, torch.float32)
        squares = x.to(wide).pow(2)
        mean = squares.mean(-1, keepdim=True) if group is None else _row_sum(squares, group) / size
        inverse_rms = torch.rsqrt(mean + eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        ctx.group, ctx.size = group, size
        return (x.to(wide) * inverse_rms * weight.to(wide)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, inverse_rms = ctx.saved_tensors
        wide = inverse_rms.dtype
        normalised = x.to(wide) * inverse_rms
        grad = grad_out.to(wide)
        grad_weight = (grad * normalised).reshape(-1, x.shape[-1]).sum(0)
        grad_normalised = grad * weight.to(wide)
        product = grad_normalised * normalised
        mean = (product.mean(-1, keepdim=True) if ctx.group is None
                else _row_sum(product, ctx.group) / ctx.size)
        grad_x = inverse_rms * (grad_normalised - normalised * mean)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None, None, None


@functools.lru_cache(maxsize=None)  # asked at every norm call: the answer is torch's, fixed per device type
def fused_kernels(device_type: str) -> bool:
    """Whether torch has fused RMSNorm kernels, forward and backward, for ``device_type`` (CUDA from torch
    2.8): they keep x and 1 / rms as ``_RMSNorm`` does, in one kernel each way. Elsewhere torch's RMSNorm is
    composite (more kernels, more saved tensors) and ``_RMSNorm`` runs."""
    return (hasattr(torch, "_fused_rms_norm") and device_type == "cuda"
            and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, split_over: AxisGroup | None = None,
             size: int | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension with ``weight``; ``split_over``: the tp group across which
    that dimension (of ``size`` channels in all) is split, or None when this rank holds it whole (torch's
    fused kernels then, where it has them)."""
    if split_over is not None and split_over.size == 1:
        split_over = None
    if split_over is None and fused_kernels(x.device.type):
        return torch._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps, split_over, size)
