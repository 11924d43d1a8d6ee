"""Token dispatchers: each routed token carried to the ranks that hold its expert, the experts run there,
and the outputs carried back and summed with the routing weights (Megatron's
--moe-token-dispatcher-type).

A layer's experts are spread over the ``dispatch`` group (etp x ep, etp fastest): ep rank r holds experts
[r E/ep, (r+1) E/ep), each split over the etp ranks of r by width. Every token must reach all etp slices of
its expert, and the slices' partial outputs are summed.

- ``alltoall``: the routed tokens, sorted by expert, go to the ranks of their experts' ep rank in one uneven
  all-to-all over the dispatch group (to each of its etp ranks: Megatron's all-to-all over ep followed by an
  all-gather over etp sends the same bytes); each rank runs its experts on what it received, grouped by
  expert, and a second all-to-all brings the outputs back, where the etp partials are summed and the
  weighted outputs added into each token's row. Bytes per layer and micro-batch, forward: the rows sent to
  other ranks (routed tokens times etp, less those a rank keeps), times h x element size; backward the same.
- ``allgather``: every rank of the dispatch group gathers all of the group's tokens and routing, runs its
  experts on the tokens routed to them, and a reduce-scatter sums the weighted outputs (and the etp partials)
  back to each token's rank. Bytes: (n-1)/n of the group's tokens each way, whatever the routing.

Both run on any device and in any group size (at one rank no communication is made); token counts are
read on the host once per layer (the uneven exchange needs its sizes), as every dropless dispatcher must.
"""

from __future__ import annotations

from typing import Callable

import torch

from parallel import comm
from parallel.comm import AxisGroup, compile_boundary
from parallel.experts.groups import ExpertGroups
from parallel.tensor.mappings import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel

# the experts of this rank: (rows grouped by local expert [M, h], rows per local expert) -> outputs [M, h]
ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class _Exchange(torch.autograd.Function):
    """Uneven all-to-all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, input_splits, output_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        return comm.all_to_all_uneven(x, input_splits, output_splits, group)

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        back = comm.all_to_all_uneven(grad.contiguous(), output_splits, input_splits, ctx.group)
        return back, None, None, None


_exchange = compile_boundary(_Exchange.apply)


def _regroup(rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows in blocks ``sizes`` [A, B] (block (a, b) of sizes[a, b] rows, a-major) reordered b-major."""
    blocks = rows.split(sizes.flatten().tolist())
    a, b = sizes.shape
    return torch.cat([blocks[i * b + j] for j in range(b) for i in range(a)]) if blocks else rows


class TokenDispatcher:
    """Carries one layer's routed tokens to its experts and back over ``ExpertGroups``. Owns no tensor and
    never changes the routing: ``run`` takes the choice the router made."""

    def __init__(self, num_experts: int, groups: ExpertGroups):
        self.groups, self.num_experts = groups, num_experts
        self.local = num_experts // groups.ep.size
        self.first = groups.ep.rank * self.local

    def run(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
            experts: ExpertsFn) -> torch.Tensor:
        """sum over chosen experts e of weights[t, e] * expert_e(x[t]), for ``x`` [T, h], ``weights`` [T, E]
        and ``chosen`` [T, E] (bool: which rows each expert receives, zero-weight padding rows included)."""
        raise NotImplementedError


class AllToAllDispatcher(TokenDispatcher):
    """--moe-token-dispatcher-type alltoall: only the routed rows travel (see the module docstring)."""

    def run(self, x, weights, chosen, experts):
        group, etp, ep = self.groups.dispatch, self.groups.etp.size, self.groups.ep.size
        expert, token = chosen.t().nonzero(as_tuple=True)  # sorted by expert, then token
        counts = chosen.sum(dim=0)  # [E]
        per_rank = counts.view(ep, self.local)
        # every etp rank of ep rank r gets r's rows; it receives [source, local expert] counts
        sent = per_rank.repeat_interleave(etp, dim=0).contiguous()
        received = torch.empty_like(sent)
        comm.all_to_all_single(received, sent, group)
        to_rank = per_rank.sum(dim=1).tolist()
        input_splits = [to_rank[g // etp] for g in range(group.size)]
        received_cpu = received.cpu()
        output_splits = received_cpu.sum(dim=1).tolist()
        rows = x.index_select(0, token)
        if etp > 1:
            blocks = rows.split(to_rank)
            rows = torch.cat([blocks[g // etp] for g in range(group.size)])
        arrived = _exchange(rows, input_splits, output_splits, group)  # [source, local expert] blocks
        out = _regroup(experts(_regroup(arrived, received_cpu), received_cpu.sum(dim=0).tolist()),
                       received_cpu.t())
        back = _exchange(out, output_splits, input_splits, group)
        if etp > 1:  # the etp slices' partial outputs of each ep rank's rows, summed
            back = torch.cat([block.view(etp, -1, block.shape[-1]).sum(dim=0)
                              for block in back.split([n * etp for n in to_rank])])
        weighted = back * weights[token, expert].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(x, dtype=back.dtype).index_add(0, token, weighted)


class AllGatherDispatcher(TokenDispatcher):
    """--moe-token-dispatcher-type allgather: every token of the group travels (see the module docstring)."""

    def run(self, x, weights, chosen, experts):
        group = self.groups.dispatch
        x_all = gather_from_sequence_parallel(x, group)
        weights_all = gather_from_sequence_parallel(weights, group)
        chosen_all = gather_rows(chosen, group)[:, self.first:self.first + self.local]
        expert, token = chosen_all.t().nonzero(as_tuple=True)
        out = experts(x_all.index_select(0, token), chosen_all.sum(dim=0).tolist())
        weighted = out * weights_all[token, self.first + expert].unsqueeze(-1).to(out.dtype)
        summed = torch.zeros_like(x_all, dtype=out.dtype).index_add(0, token, weighted)
        return reduce_scatter_to_sequence_parallel(summed, group)


def gather_rows(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 (no autograd; booleans travel as bytes)."""
    if group.size == 1:
        return x
    mine = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    out = torch.empty((mine.shape[0] * group.size, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    comm.all_gather_into_tensor(out, mine, group)
    return out.bool() if x.dtype == torch.bool else out


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
