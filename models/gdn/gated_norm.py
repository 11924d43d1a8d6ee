"""A gated delta net's output norm: RMSNorm of each value head's output times a weight shared by the heads,
times SiLU(z) (megatron-core's out_norm, then its gate; transformers' ``Qwen3NextRMSNormGated``) or, for
Kimi delta attention, sigmoid(z), in fp32 (fp64 for fp64), returned in o's dtype.

An autograd function that keeps o, z and each head's 1/rms for backward and remakes the normalised and
gated values there, instead of the intermediate tensors PyTorch's autograd would keep (in fp32 ones, twice
a bf16 run's bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class NormThenGate(torch.autograd.Function):
    """o, z [..., channels], weight [channels] -> RMSNorm(o) weight SiLU(z) (``sigmoid``: sigmoid(z))."""

    @staticmethod
    def forward(ctx, o, z, weight, eps, sigmoid_gate=False):
        fp32 = torch.promote_types(o.dtype, torch.float32)
        of = o.to(fp32)
        inverse = torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(o, z, weight, inverse)
        ctx.sigmoid_gate = sigmoid_gate
        gate = torch.sigmoid(z.to(fp32)) if sigmoid_gate else F.silu(z.to(fp32))
        return (of * inverse * weight.to(fp32) * gate).to(o.dtype)

    @staticmethod
    def backward(ctx, grad):
        o, z, weight, inverse = ctx.saved_tensors
        fp32 = inverse.dtype
        of, zf, wf, gf = o.to(fp32), z.to(fp32), weight.to(fp32), grad.to(fp32)
        normed, sigmoid = of * inverse, torch.sigmoid(zf)
        if ctx.sigmoid_gate:
            gate, d_gate = sigmoid, sigmoid * (1 - sigmoid)
        else:
            gate, d_gate = zf * sigmoid, sigmoid * (1 + zf * (1 - sigmoid))
        d_weight = (gf * gate * normed).reshape(-1, weight.shape[-1]).sum(0)
        d_normed = gf * gate * wf
        d_o = inverse * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
        d_z = gf * normed * wf * d_gate
        return d_o.to(o.dtype), d_z.to(z.dtype), d_weight.to(weight.dtype), None, None
