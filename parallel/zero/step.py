"""One optimizer step over one or more ZeRO optimizers: overflow, the global gradient norm, clipping, the
loss-scale update, then each optimizer's update."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from parallel.process_groups import module_device
from parallel.zero.loss_scaler import DynamicLossScaler


@dataclass
class StepResult:
    """What one optimizer step did: the gradient norm before clipping, whether it was skipped (an
    overflow or a non-finite norm), and the loss scale in force during the step."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float = 1.0


class SteppedPart(Protocol):
    """What ``step_together`` needs of each optimizer (``ZeroOptimizer`` has it)."""

    module: nn.Module

    def reduced_gradients(self) -> list[torch.Tensor]: ...

    def overflowed(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor: ...

    def norm_squared(self, tensors: list[torch.Tensor], scale: float,
                     device: torch.device) -> torch.Tensor: ...

    def apply(self, grads: list[torch.Tensor], scale: float, coefficient: float) -> None: ...


def combined_norm(squares: list[torch.Tensor]) -> float:
    """The norm of several parts' squared norms (one-element tensors, on any devices), read on the host."""
    return torch.stack([square.to(squares[0].device) for square in squares]).sum().sqrt().item()


def step_together(parts: list[SteppedPart], loss_scaler, clip_grad: float) -> StepResult:
    """One step of ``parts`` (optimizers over different parameters and groups: the dense and the expert
    ones) as of one optimizer: the overflow decided over all of them, one gradient norm over every
    parameter, one clipping factor, one update of the loss scale (``loss_scaler``, the one they share)."""
    scale = loss_scaler.scale
    grads = [part.reduced_gradients() for part in parts]
    devices = [g[0].device if g else module_device(part.module) for part, g in zip(parts, grads)]
    overflow = False
    if isinstance(loss_scaler, DynamicLossScaler):
        overflow = any(bool(part.overflowed(g, device).item())
                       for part, g, device in zip(parts, grads, devices))
    squared = [part.norm_squared(g, scale, device) for part, g, device in zip(parts, grads, devices)]
    norm = combined_norm(squared)  # of the unscaled gradients
    skipped = overflow or not math.isfinite(norm)
    loss_scaler.update(skipped)
    if skipped:
        return StepResult(grad_norm=norm, skipped=True, loss_scale=scale)
    coefficient = clip_grad / (norm + 1e-6) if 0 < clip_grad < norm else 1.0
    for part, g in zip(parts, grads):
        part.apply(g, scale, coefficient)
    return StepResult(grad_norm=norm, loss_scale=scale)
