"""The L2 norm of gradients (or masters) over the whole model, each parameter counted once, wherever
its chunks live: the norm clipping and ``--log-params-norm`` read."""

from __future__ import annotations

from typing import Callable

import torch

from parallel.param_meta import counts_once_here
from parallel.zero.masters import ShardSlot, by_device


def global_norm_squared(slots: list[ShardSlot], tensors: list[torch.Tensor], scale: float,
                        device: torch.device, tp_rank: int,
                        reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The squared L2 norm of ``tensors`` (one per slot, laid out as its segments) divided by ``scale``, a
    one-element tensor on ``device``. Each segment's norm is computed where the segment is, with no
    temporary of its size; the squared sum is combined on ``device`` and summed over the ranks by
    ``reduce`` (in place). Replicas of a tensor-parallel weight count on one tensor-parallel rank only
    (``tp_rank``)."""
    segments = [tensor[offset:offset + length] for slot, tensor in zip(slots, tensors)
                for param, offset, length in slot.segments if counts_once_here(param, tp_rank)]
    # one foreach norm per device, in fp32 whatever the gradients' dtype (16-bit norms overflow or round)
    norms = [norm.to(device) for same_device in by_device(segments)
             for norm in torch._foreach_norm(same_device, 2, dtype=torch.float32)]
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if norms:
        total += (torch.linalg.vector_norm(torch.stack(norms)) / scale).square()
    reduce(total)
    return total
