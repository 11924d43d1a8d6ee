"""Autograd functions that move activations into and out of tensor-parallel regions.

Each is a pair of conjugate collectives over the tensor-parallel group (forward / backward):

    copy_to_tensor_parallel        identity   / all-reduce   (input of a column-parallel layer)
    reduce_from_tensor_parallel    all-reduce / identity     (output of a row-parallel layer)
    scatter_to_sequence_parallel   keep my chunk / all-gather along dim 0
    gather_from_sequence_parallel  all-gather / reduce-scatter along dim 0 (input of an fp8 column-parallel
                                   layer under sequence parallelism)
    reduce_scatter_to_sequence_parallel  reduce-scatter / all-gather along dim 0
    gather_from_tensor_parallel    all-gather / keep my chunk along the last dim (a column-parallel
                                   output made whole: multi-token prediction's eh_proj)

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


def _conjugate(name: str, forward, backward):
    """The mapping ``forward(x, group)`` whose backward is ``backward(grad, group)``: one autograd function
    (``name``), run eagerly under torch.compile (its collectives end a compiled region); the identity at
    tp = 1, where nothing is called."""
    def forward_(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def backward_(ctx, grad):
        return backward(grad, ctx.group), None

    function = type(name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward_), "backward": staticmethod(backward_)})
    applied = compile_boundary(function.apply)

    def mapping(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        return x if group.size == 1 else applied(x, group)

    mapping.__name__ = mapping.__qualname__ = name
    return mapping


copy_to_tensor_parallel = _conjugate("copy_to_tensor_parallel", lambda x, group: x, _all_reduce)
reduce_from_tensor_parallel = _conjugate("reduce_from_tensor_parallel",
                                         lambda x, group: _all_reduce(x.clone(), group),
                                         lambda grad, group: grad)
scatter_to_sequence_parallel = _conjugate("scatter_to_sequence_parallel", _my_chunk_dim0, all_gather_dim0)
gather_from_sequence_parallel = _conjugate("gather_from_sequence_parallel", all_gather_dim0,
                                           reduce_scatter_dim0)
reduce_scatter_to_sequence_parallel = _conjugate("reduce_scatter_to_sequence_parallel", reduce_scatter_dim0,
                                                 all_gather_dim0)


def _gather_last(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return all_gather_dim0(x.movedim(-1, 0).contiguous(), group).movedim(0, -1).contiguous()


def _my_chunk_last(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


# a column-parallel output made whole on every rank (its gradient: each rank's own columns)
gather_from_tensor_parallel = _conjugate("gather_from_tensor_parallel", _gather_last, _my_chunk_last)
