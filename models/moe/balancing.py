"""The balancing losses' way into backward, and what they and the routing were in a step.

A MoE layer's balancing losses (auxiliary, sequence-auxiliary, z) never join the model's output: their
gradient is added where the layer's output flows back (``attach``), scaled as the main loss of one
micro-batch is (``gradient_scale``, which the training loop sets each step: the loss scale / micro-batches,
times cp, as gradients are averaged over the context-parallel ranks that each hold a share of the losses).
So every pipeline stage trains its own layers' balance, as Megatron's auxiliary-loss scaler does.
"""

from __future__ import annotations

import torch


class _Attach(torch.autograd.Function):
    """The identity on ``x`` whose backward also starts ``loss``'s backward, at the holder's scale."""

    @staticmethod
    def forward(ctx, x, loss, holder):
        ctx.holder = holder
        return x

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.holder.gradient_scale
        return grad, torch.full((), scale, dtype=torch.float32, device=grad.device), None


class BalancingLosses:
    """Owns, for one model's MoE layers: the factor their losses' gradients are scaled by (``gradient_scale``)
    and, summed over the layers and micro-batches since ``reset`` (forward passes that build a graph only, so
    that a recomputed forward does not count twice), each loss's value and the tokens each layer's experts
    received. Never changes routing or the main loss."""

    def __init__(self) -> None:
        self.gradient_scale = 1.0
        self.losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert: dict[int, torch.Tensor] = {}

    def attach(self, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``x``, with ``loss`` (a scalar) trained through it."""
        return _Attach.apply(x, loss, self) if loss.requires_grad else x

    def record(self, name: str, loss: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            value = loss.detach().double()
            self.losses[name] = value + self.losses[name] if name in self.losses else value

    def record_tokens(self, layer: int, counts: torch.Tensor) -> None:
        """``counts`` [E]: the tokens each of ``layer``'s experts received from this rank's tokens."""
        if torch.is_grad_enabled():
            previous = self.tokens_per_expert.get(layer)
            counts = counts.detach().to(torch.float64)
            self.tokens_per_expert[layer] = counts if previous is None else previous + counts

    def reset(self) -> None:
        self.losses.clear()
        self.tokens_per_expert.clear()
