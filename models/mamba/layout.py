"""The two row orders of a Mamba-2 mixer's fused weights.

Ours is group-major (``models.mamba.mixer``): ``in_proj`` rows group by group [z_g, x_g, B_g, C_g, dt_g],
the convolution's channels [x_g, B_g, C_g]. megatron-core and Hugging Face keep them part-major: [z | x |
B | C | dt] over all groups (and [x | B | C]), each part's rows group by group. Interop permutes with
``group_major_rows`` / ``group_major_channels`` (orders for ``models.linear_mixing.layout``'s maps).
"""

from __future__ import annotations

import torch

from models.linear_mixing.layout import group_major


def group_major_rows(inner: int, groups: int, state: int, heads: int) -> torch.Tensor:
    """``in_proj``: the part-major row of each of our rows (z, x: ``inner``; B, C: ``groups x state``; dt:
    ``heads``)."""
    return group_major([inner, inner, groups * state, groups * state, heads], groups)


def group_major_channels(inner: int, groups: int, state: int) -> torch.Tensor:
    """The convolution (weight rows and bias): the part-major channel of each of ours (x, B, C)."""
    return group_major([inner, groups * state, groups * state], groups)


def virtual_groups(groups: int, heads: int, head_dim: int, state: int, split: int, first: int,
                   count: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
    """A rank's ``groups`` groups (``heads`` heads) each cut into ``split`` virtual groups of their heads
    (sharing the group's B and C): for virtual groups ``first`` .. ``first + count - 1``, the spans [start,
    stop) of (group-major) convolution rows their channels [x, B, C] use, in order, and their heads' span."""
    per_group = heads // groups
    width, share = per_group * head_dim + 2 * state, per_group // split
    spans: list[tuple[int, int]] = []
    for virtual in range(first, first + count):
        group, part = divmod(virtual, split)
        base = group * width
        for start, stop in ((base + part * share * head_dim, base + (part + 1) * share * head_dim),
                            (base + per_group * head_dim, base + width)):  # x, then B and C whole
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], stop)
            else:
                spans.append((start, stop))
    return tuple(spans), (first * share, (first + count) * share)
