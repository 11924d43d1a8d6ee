"""Mamba-2's gated norm: RMSNorm(y * SiLU(z)) over each group's channels, times a weight (megatron-core's
``RMSNormGated`` with ``norm_before_gate=False``), in fp32 (fp64 for fp64), returned in y's dtype.

An autograd function that keeps y, z and each group's 1/rms for backward (as the fused kernel does) and
remakes the gated and normalised values there, instead of the five intermediate tensors PyTorch's
autograd would keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatedRMSNorm(torch.autograd.Function):
    """y, z [..., groups, channels], weight [groups x channels] -> [..., groups x channels]."""

    @staticmethod
    def forward(ctx, y, z, weight, eps):
        fp32 = torch.promote_types(y.dtype, torch.float32)
        gated = y.to(fp32) * F.silu(z.to(fp32))
        inverse = torch.rsqrt(gated.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(y, z, weight, inverse)
        return ((gated * inverse).flatten(-2) * weight.to(fp32)).to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        y, z, weight, inverse = ctx.saved_tensors
        fp32 = inverse.dtype
        zf, yf = z.to(fp32), y.to(fp32)
        gate = F.silu(zf)
        normed = yf * gate * inverse
        grad = grad.to(fp32)
        weight_grad = (grad * normed.flatten(-2)).reshape(-1, weight.shape[0]).sum(0)
        grad_normed = (grad * weight.to(fp32)).unflatten(-1, normed.shape[-2:])
        grad_gated = inverse * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        sigmoid = torch.sigmoid(zf)
        grad_z = grad_gated * yf * sigmoid * (1 + zf * (1 - sigmoid))
        return (grad_gated * gate).to(y.dtype), grad_z.to(z.dtype), weight_grad.to(weight.dtype), None
