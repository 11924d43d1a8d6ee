"""From sequence shards to head shards and back over the context-parallel group (one all-to-all each way).

A cp rank holds chunks i and 2cp-1-i of each sequence (``parallel.context.sharding``). ``to_heads`` sends
part j of its tokens' data to cp rank j and returns, for its own part, every rank's tokens in natural
order: a layer that needs whole sequences (attention under ``--cp-comm-type a2a``, a Mamba scan) then runs
on its share of the heads. ``to_sequence`` is the inverse. Each rank sends (cp - 1) / cp of what it
exchanges; backward is the same all-to-alls in reverse.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup, compile_boundary


class _SwapParts(torch.autograd.Function):
    """x [cp, ...]: part j goes to cp rank j, part i of the result came from rank i (its own inverse)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, cp)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, ctx.cp)
        return out, None


@compile_boundary  # it exchanges over the cp group
def to_heads(parts: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """``parts`` [cp, ..., s, d]: part j (this rank's s tokens, in its zig-zag order) for cp rank j ->
    [..., S, d]: this rank's part of every rank's tokens, in natural order."""
    n = cp.size
    received = _SwapParts.apply(parts, cp)  # [source rank, ..., s, d]
    first, second = received.chunk(2, dim=-2)  # the source's chunks i and 2cp-1-i
    return torch.cat([first[c] if c < n else second[2 * n - 1 - c] for c in range(2 * n)], dim=-2)


@compile_boundary
def to_sequence(y: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """The inverse of ``to_heads``: [..., S, d] -> [cp, ..., s, d], part j what cp rank j computed for this
    rank's tokens."""
    n = cp.size
    chunks = y.chunk(2 * n, dim=-2)
    parts = torch.stack([torch.cat([chunks[j], chunks[2 * n - 1 - j]], dim=-2) for j in range(n)])
    return _SwapParts.apply(parts, cp)
