"""Contiguous storage for a group of parameters (and their gradients), cut into buckets and shards.

Parameters of one dtype are laid out back to back in one flat tensor, in reverse registration order
(roughly the order backward produces their gradients), grouped into buckets of at least
``bucket_size`` elements. Each bucket is padded to a multiple of ``num_shards`` and split into that
many equal chunks: data-parallel rank r owns chunk r of every bucket, so one reduce-scatter per
bucket leaves each rank exactly its part of the gradient, and one all-gather per bucket rebuilds
the parameters. Parameters whose gradients need a model-parallel reduction first (``deferred``) go
into buckets of their own at the end.

Each parameter's ``.data`` is a view into the flat tensor. The gradient buffer may have another dtype
than the parameters (fp32 main gradients for bf16 parameters, as Megatron keeps them): where the
dtypes agree ``.grad`` is a view too and autograd accumulates into it in place; where they differ the
gradient sync adds each fresh ``.grad`` into the buffer and drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel.param_meta import meta


def initial_value(param: nn.Parameter) -> torch.Tensor:
    """The values a parameter starts from: its data, or its recipe if it was built on the meta device."""
    if param.is_meta:
        init_fn = meta(param).init_fn
        if init_fn is None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} was built on the meta device "
                             "without "
                             "an init_fn to materialise it from (parallel.param_meta.declare)")
        return init_fn()
    return param.data


def point_at(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` use ``view``'s storage. A parameter built on the meta device cannot take data of
    another device, so its whole tensor is swapped (keeping its identity and attributes)."""
    if param.is_meta:
        attributes = dict(param.__dict__)
        torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
        param.__dict__.update(attributes)
    else:
        param.data = view


def pieces_within(ranges, low: int, high: int) -> list[tuple[nn.Parameter, int, int]]:
    """(param, offset from ``low``, length) of each (param, start, end) range that meets [low, high)."""
    return [(param, max(start, low) - low, min(end, high) - max(start, low))
            for param, start, end in ranges if start < high and end > low]


@dataclass(frozen=True)
class Bucket:
    """A contiguous, shard-aligned element range [start, end) of the buffer and its parameters."""

    index: int
    start: int
    end: int
    params: tuple[nn.Parameter, ...]
    deferred: bool
    num_shards: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk(self) -> int:
        """Elements each shard owns in this bucket."""
        return self.numel // self.num_shards

    def chunk_range(self, shard: int) -> tuple[int, int]:
        return self.start + shard * self.chunk, self.start + (shard + 1) * self.chunk


@dataclass(frozen=True)
class Segment:
    """``length`` elements of ``param`` that lie in one shard chunk, at ``offset`` of that chunk."""

    param: nn.Parameter
    bucket: int
    offset: int
    length: int


class FlatParameterBuffer:
    """Owns the flat parameter (and optionally gradient) storage of same-dtype parameters.

    Owns: ``data``, ``grad`` (None when gradients are not kept whole), each parameter's offset, the
    buckets. A bucket never holds parameters of two ``part``s (a pipeline rank's model chunks: one backward
    pass gives every parameter of its chunk a gradient, so a bucket of one chunk is complete after each,
    while one spanning two would see one chunk's micro-batches arrive before the other's). Never
    communicates and never steps an optimizer; it only lays memory out.
    """

    def __init__(self, params: list[nn.Parameter], bucket_size: int, num_shards: int = 1,
                 keep_grad: bool = True,
                 deferred: Callable[[nn.Parameter], bool] = lambda param: False,
                 device: torch.device | None = None,
                 grad_dtype: torch.dtype | None = None,
                 part: Callable[[nn.Parameter], int] = lambda param: 0):
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        if bucket_size < 1:
            raise ValueError(f"--zero-bucket-size must be >= 1 element, got {bucket_size}")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"a flat buffer holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype, self.device, self.num_shards = params[0].dtype, device or params[0].device, num_shards
        ordered = list(reversed(params))
        self.offsets: dict[nn.Parameter, int] = {}
        self.buckets: list[Bucket] = []
        end = 0
        for is_deferred in (False, True):
            members: list[nn.Parameter] = []
            for param in (p for p in ordered if deferred(p) == is_deferred):
                if members and part(param) != part(members[-1]):
                    end = self._close_bucket(members, end, is_deferred)
                    members = []
                self.offsets[param] = end + sum(p.numel() for p in members)
                members.append(param)
                if sum(p.numel() for p in members) >= bucket_size:
                    end = self._close_bucket(members, end, is_deferred)
                    members = []
            if members:
                end = self._close_bucket(members, end, is_deferred)
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self.numel = end
        self.data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for param in self.params:
            view = self.data[self.offsets[param]:self.offsets[param] + param.numel()].view_as(param)
            view.copy_(initial_value(param))
            point_at(param, view)
        self.grad_dtype = grad_dtype or self.dtype
        self.grad = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device) if keep_grad else None
        # each parameter's view of the flat gradient, made once (the backward hooks ask for it every step)
        self._grad_views = ({param: self.grad[self.offsets[param]:self.offsets[param]
                                              + param.numel()].view_as(param)
                             for param in self.params} if keep_grad else {})
        self.attach_grads()

    def _close_bucket(self, members: list[nn.Parameter], start: int, deferred: bool) -> int:
        used = sum(p.numel() for p in members)
        end = start + -(-used // self.num_shards) * self.num_shards
        self.buckets.append(Bucket(len(self.buckets), start, end, tuple(members), deferred, self.num_shards))
        return end

    def param_range(self, param: nn.Parameter) -> tuple[int, int]:
        return self.offsets[param], self.offsets[param] + param.numel()

    def grad_view(self, param: nn.Parameter) -> torch.Tensor:
        return self._grad_views[param]

    @property
    def grads_are_views(self) -> bool:
        """Whether each ``param.grad`` is its view of the flat gradient (else it is added in and dropped)."""
        return self.grad is not None and self.grad_dtype == self.dtype

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its view of the flat gradient (autograd accumulates in place);
        where the buffer keeps no gradient or keeps it in another dtype, clear them instead."""
        views = self.grads_are_views
        for param in self.params:
            if not views:
                param.grad = None
            elif param.grad is not self._grad_views[param]:
                param.grad = self._grad_views[param]

    def segments(self, shard: int) -> list[Segment]:
        """How the parameters fall into shard ``shard``'s chunks."""
        found = []
        for bucket in self.buckets:
            ranges = [(param, *self.param_range(param)) for param in bucket.params]
            found += [Segment(param, bucket.index, offset, length)
                      for param, offset, length in pieces_within(ranges, *bucket.chunk_range(shard))]
        return found
