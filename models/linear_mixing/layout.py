"""Group-major and part-major row orders of a linear-time mixer's fused weights, and the map between them.

Ours keep a group's (a Mamba-2 group's, a delta net's key head's) rows together, so that a contiguous tp
slice holds whole groups; megatron-core and Hugging Face keep each part's rows together over all groups.
``group_major`` gives, for part sizes and a group count, the part-major row of each of our rows: ours =
theirs[order] (``to_group_major``), theirs[order] = ours (``to_part_major``).
"""

from __future__ import annotations

import torch


def group_major(parts: list[int], groups: int) -> torch.Tensor:
    """For part-major rows of ``parts`` (each part's total rows, split evenly over ``groups``), the
    part-major row of each group-major row (a gated delta net's key heads are its groups)."""
    starts = torch.tensor([0] + parts[:-1]).cumsum(0).tolist()
    order = []
    for group in range(groups):
        for start, rows in zip(starts, parts):
            share = rows // groups
            order.extend(range(start + group * share, start + (group + 1) * share))
    return torch.tensor(order)


def to_group_major(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Part-major rows -> ours."""
    return tensor[order]


def to_part_major(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Our rows -> part-major."""
    out = torch.empty_like(tensor)
    out[order] = tensor
    return out
