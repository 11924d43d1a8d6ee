"""All-gather attention (``--cp-comm-type allgather``): every rank gathers the whole sequence's K/V.

Keys and values are all-gathered over the cp group in forward, and this rank's queries attend to each
rank's block in turn (``zigzag_blocks``: the chunk pairs of ring attention, merged by their log-sum-exp,
the same dropout masks in the same order). As Llama 3's all-gather context parallelism does, backward
gathers the keys and values again instead of keeping them: only this rank's q, k, v, its output and
log-sum-exp are kept (1/cp of the sequence, as ring attention keeps), the whole sequence's K/V is held only
while a layer's attention runs, and no attention is computed twice. The fp32 dK/dV of every block are
reduce-scattered back to their owners.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.context.local_attention import ScoreOptions
from parallel.context.zigzag_blocks import Queries, sources


def _gathered(k: torch.Tensor, v: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[source rank, 2, *k.shape]: every cp rank's keys and values."""
    mine = torch.stack([k, v])
    everyone = mine.new_empty((cp.size, *mine.shape))
    comm.all_gather_into_tensor(everyone, mine, cp)
    return everyone


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, options, dropout, rng, documents):
        mine = Queries.of(q, cp, options, dropout, rng, documents)
        out, lse = [None, None], [None, None]
        everyone = _gathered(k, v, cp)
        for source in sources(cp.size, cp.rank):
            mine.forward(q, source, everyone[source, 0], everyone[source, 1], out, lse)
        result = torch.cat(out, dim=3).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=3))
        ctx.cp, ctx.mine = cp, mine
        return result

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, result, lse = ctx.saved_tensors
        cp, mine = ctx.cp, ctx.mine
        grad_output, delta, grad_q, keeps = mine.start_backward(q, grad_output, result)
        everyone = _gathered(k, v, cp)  # again: not kept since forward
        grad_everyone = torch.empty((cp.size, 2, *k.shape), dtype=torch.float32, device=k.device)
        for source in sources(cp.size, cp.rank):
            grad_everyone[source] = mine.backward(q, source, everyone[source, 0], everyone[source, 1],
                                                  grad_output, result, lse, delta, grad_q, keeps)
        grad_kv = grad_everyone.new_empty(grad_everyone.shape[1:])
        comm.reduce_scatter_tensor(grad_kv, grad_everyone, cp)
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None, None, None)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: AxisGroup,
                        options: ScoreOptions, dropout: float = 0.0, rng=None,
                        documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, G, Q, s, d] on the gathered k, v [b, G, s, d] (all in
    zig-zag order), scored as ``options`` say; ``documents`` [b, S]: attention stays within a document.
    Returns [b, G, Q, s, d]."""
    return _AllGatherAttention.apply(q, k, v, cp, options, dropout, rng, documents)
