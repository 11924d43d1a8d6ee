"""Autograd functions that move activations into and out of tensor-parallel regions.

Each is a pair of conjugate collectives over the tensor-parallel group (forward / backward):

    copy_to_tensor_parallel        identity   / all-reduce   (input of a column-parallel layer)
    reduce_from_tensor_parallel    all-reduce / identity     (output of a row-parallel layer)
    scatter_to_sequence_parallel   keep my chunk / all-gather along dim 0
    reduce_scatter_to_sequence_parallel  reduce-scatter / all-gather along dim 0

All communication goes through ``parallel.comm``; at tp = 1 every function is the identity. Under
``torch.compile`` each is a ``compile_boundary``.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup, compile_boundary


def _all_reduce(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    comm.all_reduce(x, group)
    return x


def all_gather_dim0(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Concatenate every tp rank's ``x`` along dim 0 (no autograd)."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x, group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum ``x`` over the tp group and keep this rank's chunk of dim 0 (no autograd)."""
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {group.size} tensor-parallel ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, x, group)
    return out


def _my_chunk_dim0(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {group.size} tensor-parallel ranks")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_chunk_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


# each runs eagerly under torch.compile (its collectives end a compiled region); at tp = 1 none is called
_copy_to, _reduce_from, _scatter_to, _gather_from, _reduce_scatter_to = (
    compile_boundary(function.apply) for function in (_CopyToTensorParallel, _ReduceFromTensorParallel,
                                                      _ScatterToSequenceParallel, _GatherFromSequenceParallel,
                                                      _ReduceScatterToSequenceParallel))


def copy_to_tensor_parallel(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _copy_to(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _reduce_from(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _scatter_to(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The whole sequence from every rank's part (dim 0); backward keeps this rank's part of the summed
    gradient."""
    return x if group.size == 1 else _gather_from(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _reduce_scatter_to(x, group)
