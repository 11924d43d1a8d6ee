"""A function run so that autograd keeps only its tensor inputs, and redoes it in backward (what the fused
Mamba-2 kernels do with their convolution and chunks): memory of the inputs, not of the intermediates."""

from __future__ import annotations

import torch


class Recomputed(torch.autograd.Function):
    """``Recomputed.apply(fn, static, *tensors)`` = ``fn(*tensors, *static)``; ``tensors`` may hold None."""

    @staticmethod
    def forward(ctx, fn, static, *tensors):
        ctx.fn, ctx.static = fn, static
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors, *static)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None
                  for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs, *ctx.static)
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return None, None, *(next(found) if t is not None and t.requires_grad else None for t in inputs)
