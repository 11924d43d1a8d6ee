"""Many experts' linear layers in one call: rows of the input grouped by expert, each group times its own
weight, as one grouped matrix product (``torch._grouped_mm``) where torch has it for these shapes, else one
product per expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import compile_boundary
from parallel.tensor.weight_grad import WeightGradStore, weight_gradient

_ALIGNMENT = 16  # bytes: the grouped product wants every row stride a multiple of it


def grouped_supported(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether torch's grouped product takes ``x`` [rows, in] times weights [experts, out, in]."""
    return (hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16)
            and all(n * x.element_size() % _ALIGNMENT == 0 for n in (in_features, out_features)))


class _ContiguousGradient(torch.autograd.Function):
    """The identity whose backward hands on a contiguous gradient (the grouped product's backward refuses
    an expanded one, as a sum's gradient is)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _product(x: torch.Tensor, weights: list[torch.Tensor], counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows ``counts[e]`` of ``x`` times ``weights[e]`` [out, in] transposed: [rows, out]."""
    out_features, in_features = weights[0].shape
    if grouped and grouped_supported(x, in_features, out_features) and x.shape[0] > 0:
        ends = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _grouped_mm(x.contiguous(), torch.stack(weights).transpose(-2, -1), ends)
    return torch.cat([F.linear(rows, weight) for rows, weight in zip(x.split(counts), weights)]) \
        if weights else x.new_empty((0, out_features))


class _DeferringProduct(torch.autograd.Function):
    """``_product`` over the experts' weights (the parameters themselves, flattened here) whose backward,
    inside a split backward's input pass (``store``, ``parallel.tensor.weight_grad``), leaves each expert's
    weight gradient (its rows' output gradient times its rows) to the store's weight pass."""

    @staticmethod
    def forward(ctx, x, counts, grouped, store, anchor, *weights):
        ctx.counts, ctx.grouped, ctx.store, ctx.weights = counts, grouped, store, weights
        ctx.save_for_backward(x, *weights)
        return _product(x, [w.flatten(0, -2) for w in weights], counts, grouped)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _product(grad, [w.flatten(0, -2).t() for w in weights], ctx.counts, ctx.grouped)
        pieces = list(zip(grad.split(ctx.counts), x.split(ctx.counts), [w.shape for w in weights]))

        def weight_grad(grad_rows: torch.Tensor, rows: torch.Tensor, shape: torch.Size):
            return lambda: grad_rows.t().matmul(rows).view(shape)

        return (grad_x, None, None, None, None) + tuple(
            weight_gradient(ctx.store, param, weight_grad(*piece), x, grad)
            for param, piece in zip(ctx.weights, pieces))


_deferring_product = compile_boundary(_DeferringProduct.apply)  # it keeps Python state for a split backward


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], counts: list[int],
                   biases: list[torch.Tensor] | None = None, grouped: bool = True,
                   weight_grads: WeightGradStore | None = None) -> torch.Tensor:
    """Rows ``counts[e]`` of ``x`` (consecutive, in expert order) times ``weights[e]`` [out, in] (transposed,
    as ``F.linear``; a stacked [k, out, in] weight is flattened to [k out, in]) plus ``biases[e]``: [rows,
    out]. ``grouped``: one grouped product over the stacked weights where torch has one for these shapes
    (the weights are stacked: a copy), else a loop. ``weight_grads``: a split backward defers the weights'
    gradients to it (``parallel.tensor.weight_grad``)."""
    if weight_grads is not None:
        out = _deferring_product(x, counts, grouped, weight_grads, weight_grads.anchor, *weights)
    else:
        out = _product(x, [w.flatten(0, -2) for w in weights], counts, grouped)
    if biases is not None:
        out = out + torch.stack(biases).repeat_interleave(torch.tensor(counts, device=x.device), dim=0)
    return out


@compile_boundary  # dynamo has no rule for the grouped product's data-dependent offsets on every release
def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return _ContiguousGradient.apply(torch._grouped_mm(x, weights, offs=ends))
