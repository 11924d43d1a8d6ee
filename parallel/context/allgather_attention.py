"""All-gather attention (``--cp-comm-type allgather``): every rank gathers the whole sequence's K/V.

Keys and values are all-gathered over the cp group in forward (each rank then holds all of them for
the layer's attention) and their gradients reduce-scattered in backward; queries stay local. The
simplest of the three, and the one whose memory grows with the whole sequence.
"""

from __future__ import annotations

import contextlib

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.context.local_attention import ScoreOptions, attend, visible
from parallel.context.sharding import token_indices


class _GatherSequence(torch.autograd.Function):
    """x -> [cp, *x.shape], every rank's x; backward sums each rank's part of the gradient onto it."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        out = x.new_empty((cp.size, *x.shape))
        comm.all_gather_into_tensor(out, x.contiguous(), cp)
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter_tensor(mine, grad.contiguous(), ctx.cp)
        return mine, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: AxisGroup,
                        options: ScoreOptions, dropout: float = 0.0, rng=None,
                        documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, G, Q, s, d] on the gathered k, v [b, G, s, d] (all in
    zig-zag order), scored as ``options`` say; ``documents`` [b, S]: attention stays within a document.
    Returns [b, G, Q, s, d]."""
    n = cp.size
    gathered = _GatherSequence.apply(torch.stack([k, v]), cp)  # [source rank, 2, b, G, s, d]
    first, second = gathered.chunk(2, dim=-2)
    whole = torch.cat([first[c] if c < n else second[2 * n - 1 - c] for c in range(2 * n)], dim=-2)
    b, groups, queries, length, d = q.shape
    # [b or 1, 1, s, S]: 4-D, the shape torch's fused kernels take (a 3-D mask falls back to the math
    # path, which saves s x S)
    mask = visible(token_indices(length * n, n, cp.rank, q.device), torch.arange(length * n, device=q.device),
                   options.window, documents)
    with rng.fork() if rng is not None and dropout > 0 else contextlib.nullcontext():
        out = attend(q.flatten(1, 2), whole[0], whole[1], options, mask, dropout)
    return out.view(b, groups, queries, length, d)
