"""What the parallel machinery must know about a parameter, declared once where the parameter is made.

Layers declare it (``declare(param, tensor_parallel=True, partition_dim=0)``); the gradient sync, the
ZeRO optimizer, checkpoints and export read it with ``meta(param)``. A frozen dataclass: a misspelt
field fails loudly on write and on read, where ad-hoc attributes read with a default would not.
A parameter nobody declared (a plain torch model) has the defaults: replicated, whole, its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

_ATTRIBUTE = "_parallel_meta"


@dataclass(frozen=True)
class ParamMeta:
    """A parameter's place in the parallel layout.

    ``tensor_parallel``: a slice of a weight split over the tp group along ``partition_dim``;
    ``sequence_parallel``: replicated over tp but fed a sequence shard, so its gradient is partial and summed
    over tp; ``tied_embedding``: the word embedding shared by the first and last pipeline stage, its gradient
    summed over the embedding group (on one rank where it holds both: zbv's first stage); ``tied_copy``: the
    last stage's copy of it (counted once, on the first stage); ``unpadded_rows``: rows beyond are vocabulary
    padding (dropped by checkpoints and exports); ``expert``: a weight of one expert of a mixture of experts,
    held by the ranks of its expert-parallel place and replicated over the expert data-parallel group (ZeRO
    reduces and shards it there; its tp split and sequence-parallel sum are over the expert tp group);
    ``fused_rows``: the rows are query groups, each of these many rows of q (and its gate), k and v in
    turn (a fused QKV weight: Muon orthogonalizes each part on its own); ``muon``: whether Muon steps it
    (None: by its shape, a matrix; False for a fused projection of unlike parts or a convolution's taps,
    as Megatron's Muon leaves them to AdamW); ``init_fn``: rebuilds the initial value (a model made on the
    meta device is materialised from it). Never holds tensors or groups.
    """

    tensor_parallel: bool = False
    partition_dim: int | None = None
    sequence_parallel: bool = False
    tied_embedding: bool = False
    tied_copy: bool = False
    unpadded_rows: int | None = None
    expert: bool = False
    fused_rows: tuple[int, ...] | None = None
    muon: bool | None = None
    init_fn: Callable[[], torch.Tensor] | None = None


_DEFAULT = ParamMeta()


def meta(param: nn.Parameter) -> ParamMeta:
    """The declared metadata of ``param`` (the defaults if none was declared)."""
    return param.__dict__.get(_ATTRIBUTE, _DEFAULT)


def declare(param: nn.Parameter, **fields) -> nn.Parameter:
    """Add ``fields`` to ``param``'s metadata (TypeError for a field that does not exist); returns it."""
    param.__dict__[_ATTRIBUTE] = replace(meta(param), **fields)
    return param


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    """True if this rank's copy of ``param`` is the one that counts in a sum over the whole model.

    Tensor-parallel slices count everywhere; weights replicated over tp count on tp rank 0 only; the
    last pipeline stage's copy of the tied embedding (``tied_copy``) never counts.
    """
    declared = meta(param)
    if declared.tied_copy:
        return False
    return declared.tensor_parallel or tp_rank == 0
