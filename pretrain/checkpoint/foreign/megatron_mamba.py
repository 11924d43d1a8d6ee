"""A Mamba-2 mixer's fused tensors as a Megatron-LM HybridModel checkpoint keeps them.

megatron-core's ``MambaMixer`` keeps ``in_proj``'s rows part-major, [z | x | B | C | dt], and the
convolution's channels [x | B | C]; ours are group-major (``models.mamba.layout``). A legacy rank file
holds each tp rank's slice part-major over that rank's own groups, so its rows become our rank slice by
the permutation of one rank's sizes. torch_dist saves each part under a key of its own
(``mixer.in_proj.weight.z`` .. ``.dt``, ``mixer.conv1d.weight.x`` .. ``.C``), each the whole part split
over tp: joined in order they are the global part-major tensor. Holds no tensor of its own.
"""

from __future__ import annotations

import torch

from models.config import GPTConfig
from models.mamba.layout import group_major_channels, group_major_rows, to_group_major, to_part_major

# the mixer's tensors Megatron keeps part-major (within a layer), and torch_dist's names of their parts
PARTS = {"mixer.in_proj.weight": ("z", "x", "B", "C", "dt"), "mixer.conv1d.weight": ("x", "B", "C"),
         "mixer.conv1d.bias": ("x", "B", "C")}
# Megatron-LM main's legacy names of the convolution's tensors (direct mixer parameters since #4899)
_CONV_KEYS = {"mixer.conv1d_weight": "mixer.conv1d.weight", "mixer.conv1d_bias": "mixer.conv1d.bias"}


def _order(inner_key: str, config: GPTConfig, tp: int) -> torch.Tensor | None:
    """The part-major row of each of our rows of one of ``tp`` ranks' slices of the layer's tensor
    ``inner_key`` (Megatron's key within the layer); None for a tensor whose rows are alike in both."""
    key = _CONV_KEYS.get(inner_key, inner_key)
    if key not in PARTS:
        return None
    inner, groups = config.mamba_inner // tp, config.mamba_num_groups // tp
    if key == "mixer.in_proj.weight":
        return group_major_rows(inner, groups, config.mamba_state_dim, config.mamba_heads // tp)
    return group_major_channels(inner, groups, config.mamba_state_dim)


def to_ours(inner_key: str, tensor: torch.Tensor, config: GPTConfig, tp: int) -> torch.Tensor:
    """Megatron's ``tensor`` (one of ``tp`` ranks' slices of layer tensor ``inner_key``) in our row
    order."""
    order = _order(inner_key, config, tp)
    return tensor if order is None else to_group_major(tensor, order)


def to_megatron(inner_key: str, tensor: torch.Tensor, config: GPTConfig, tp: int) -> torch.Tensor:
    """Our ``tensor`` (one of ``tp`` ranks' slices) in Megatron's row order of layer tensor
    ``inner_key``."""
    order = _order(inner_key, config, tp)
    return tensor if order is None else to_part_major(tensor, order)


def part_rows(inner_key: str, config: GPTConfig) -> list[int]:
    """The whole rows of each of torch_dist's parts of layer tensor ``inner_key`` (one of ``PARTS``)."""
    inner, bc = config.mamba_inner, config.mamba_num_groups * config.mamba_state_dim
    rows = {"z": inner, "x": inner, "B": bc, "C": bc, "dt": config.mamba_heads}
    return [rows[part] for part in PARTS[inner_key]]


def split_parts(inner_key: str, tensor: torch.Tensor, config: GPTConfig) -> dict[str, torch.Tensor]:
    """A whole part-major tensor as torch_dist's part keys' suffixes -> their tensors."""
    return dict(zip(PARTS[inner_key], tensor.split(part_rows(inner_key, config))))


def joined_key(key: str) -> tuple[str, str] | None:
    """(the whole tensor's key, the part) of a torch_dist part key ``...mixer.in_proj.weight.z``; None
    for another key."""
    whole, _, part = key.rpartition(".")
    for inner, parts in PARTS.items():
        if whole.endswith("." + inner) and part in parts:
            return whole, part
    return None
