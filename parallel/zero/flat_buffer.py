"""Contiguous storage for a group of parameters and their gradients, cut into buckets and shards.

Parameters of one dtype are laid out back to back in one flat tensor (in reverse registration order,
which is roughly the order backward produces their gradients), padded so the total splits into
``num_shards`` equal shards. Each parameter's ``.data`` and ``.grad`` become views into the flat
``data`` and ``grad`` tensors, so one collective can move many gradients at once and the optimizer
can work on a contiguous shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Bucket:
    """A contiguous element range [start, end) of the buffer and the parameters that lie in it."""

    index: int
    start: int
    end: int
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatParameterBuffer:
    """Owns the flat parameter and gradient storage of a list of same-dtype parameters.

    Owns: ``data`` and ``grad`` (flat, padded), each parameter's offset, the bucket ranges. Never
    communicates and never steps an optimizer; it only lays memory out.
    """

    def __init__(self, params: list[nn.Parameter], bucket_size: int, num_shards: int = 1):
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        if bucket_size < 1:
            raise ValueError(f"--zero-bucket-size must be >= 1 element, got {bucket_size}")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"a flat buffer holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype, self.device = params[0].dtype, params[0].device
        self.params = list(reversed(params))
        self.offsets: dict[nn.Parameter, int] = {}
        total = 0
        for param in self.params:
            self.offsets[param] = total
            total += param.numel()
        self.numel_unpadded = total
        self.num_shards = num_shards
        self.numel = -(-total // num_shards) * num_shards
        self.data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for param in self.params:
            view = self.data[self.offsets[param]:self.offsets[param] + param.numel()].view_as(param)
            view.copy_(param.data)
            param.data = view
        self.attach_grads()
        self.buckets = self._cut_buckets(bucket_size)

    def _cut_buckets(self, bucket_size: int) -> list[Bucket]:
        buckets, members, start = [], [], 0
        for param in self.params:
            members.append(param)
            end = self.offsets[param] + param.numel()
            if end - start >= bucket_size:
                buckets.append(Bucket(len(buckets), start, end, tuple(members)))
                members, start = [], end
        if members:
            buckets.append(Bucket(len(buckets), start, self.numel, tuple(members)))
        else:  # the padding joins the last bucket
            last = buckets[-1]
            buckets[-1] = Bucket(last.index, last.start, self.numel, last.params)
        return buckets

    def grad_view(self, param: nn.Parameter) -> torch.Tensor:
        offset = self.offsets[param]
        return self.grad[offset:offset + param.numel()].view_as(param)

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its view of the flat gradient (autograd accumulates in place)."""
        for param in self.params:
            param.grad = self.grad_view(param)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Element range [start, end) of shard ``shard`` of the padded buffer."""
        size = self.numel // self.num_shards
        return shard * size, (shard + 1) * size
