"""The global gradient norm over every axis, counting each parameter exactly once."""

from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.comm import AxisGroup


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank's copy of ``param`` is the one that counts in a global sum over the model.

    Tensor-parallel slices count everywhere; weights replicated over tp count on tp rank 0 only; the
    last pipeline stage's copy of the tied embedding (``tied_copy``) never counts.
    """
    if getattr(param, "tied_copy", False):
        return False
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


def global_grad_norm(grads: list[tuple[nn.Parameter, torch.Tensor]], tp_rank: int,
                     reduce_groups: list[AxisGroup]) -> torch.Tensor:
    """L2 norm of all gradients of the model: local sum of squares of the copies that count once,
    summed over ``reduce_groups`` (the model-parallel group, plus the data-parallel group where
    gradients are sharded). Returns a float32 scalar identical on every rank."""
    total = torch.zeros((), dtype=torch.float32, device=grads[0][1].device if grads else "cpu")
    for param, grad in grads:
        if counts_once_here(param, tp_rank):
            total += grad.float().pow(2).sum()
    total = total.reshape(1)
    for group in reduce_groups:
        comm.all_reduce(total, group)
    return total.sqrt().squeeze(0)
