"""The mixers' fused tensors as a Megatron-LM HybridModel checkpoint keeps them: part-major.

megatron-core keeps a Mamba-2 mixer's ``in_proj`` rows [z | x | B | C | dt] and its convolution's
channels [x | B | C], a gated delta net's ``in_proj`` rows [q | k | v | z | beta | alpha] and its
convolution's [q | k | v]: each part's rows group by group (a Mamba group, a gated delta net's key head
with its value heads). Ours are group-major (``models.linear_mixing.layout``), so a contiguous tp slice
is whole groups. A legacy rank file holds each tp rank's slice part-major over that rank's own groups, so
its rows become our rank slice by the permutation of one rank's sizes. torch_dist saves each part under
a key of its own (``mixer.in_proj.weight.z`` .. ``.dt``, ``self_attention.in_proj.weight.query`` ..
``.alpha``), each the whole part split over tp: joined in order they are the global part-major tensor.
Holds no tensor of its own.
"""

from __future__ import annotations

from typing import Callable

import torch

from models.config import GPTConfig
from models.linear_mixing.layout import group_major, to_group_major, to_part_major


def _mamba_rows(config: GPTConfig) -> dict[str, int]:
    inner, bc = config.mamba_inner, config.mamba_num_groups * config.mamba_state_dim
    return {"z": inner, "x": inner, "B": bc, "C": bc, "dt": config.mamba_heads}


# each part-major tensor (Megatron's key within a layer): torch_dist's names of its parts, their whole
# rows and the groups they are laid out by
_MAMBA = (_mamba_rows, lambda config: config.mamba_num_groups)
_GDN = (lambda config: config.gdn_projection_parts, lambda config: config.linear_num_key_heads)
PARTS = {"mixer.in_proj.weight": ("z", "x", "B", "C", "dt"), "mixer.conv1d.weight": ("x", "B", "C"),
         "mixer.conv1d.bias": ("x", "B", "C"),
         "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
         "self_attention.conv1d.weight": ("query", "key", "value")}
_SIZES: dict[str, tuple[Callable[[GPTConfig], dict[str, int]], Callable[[GPTConfig], int]]] = {
    "mixer.in_proj.weight": _MAMBA, "mixer.conv1d.weight": _MAMBA, "mixer.conv1d.bias": _MAMBA,
    "self_attention.in_proj.weight": _GDN, "self_attention.conv1d.weight": _GDN}
# Megatron-LM main's legacy names of the Mamba convolution's tensors (direct mixer parameters since #4899)
_CONV_KEYS = {"mixer.conv1d_weight": "mixer.conv1d.weight", "mixer.conv1d_bias": "mixer.conv1d.bias"}


def _order(inner_key: str, config: GPTConfig, tp: int) -> torch.Tensor | None:
    """The part-major row of each of our rows of one of ``tp`` ranks' slices of the layer's tensor
    ``inner_key`` (Megatron's key within the layer); None for a tensor whose rows are alike in both."""
    key = _CONV_KEYS.get(inner_key, inner_key)
    if key not in PARTS:
        return None
    groups = _SIZES[key][1](config)
    return group_major([rows // tp for rows in part_rows(key, config)], groups // tp)


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
    rows = _SIZES[inner_key][0](config)
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
