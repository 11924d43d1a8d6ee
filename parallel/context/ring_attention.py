"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel the cp ring, never gathered.

Each rank starts with its own K/V (its two zig-zag chunks) and, in cp steps, meets every rank's: at
each step it posts the send of the block it holds to the next rank and the receive of the previous
rank's (one batch of isend/irecv, the NCCL-safe pairing the pipeline uses), computes attention on the
block it holds while that transfer runs, and merges the partial result exactly by its log-sum-exp
(``zigzag_blocks``: the chunk pairs, causal, windowed and document masks). Backward sends the K/V blocks
round again and, one step behind them, the fp32 dK/dV accumulators, which arrive back at their owner after
the last step.
A rank holds at most its own block, the one in flight and one accumulator: never the whole sequence.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.context.local_attention import ScoreOptions
from parallel.context.zigzag_blocks import Queries, sources

KV, GRAD_KV = 11, 12  # the tags of the two streams between ring neighbours (gloo matches on them)


class _Transfer:
    """One block sent to the next rank of the ring while the previous rank's arrives."""

    def __init__(self, tensor: torch.Tensor, cp: AxisGroup, tag: int):
        self.sent, self.received = tensor.contiguous(), torch.empty_like(tensor)
        following, preceding = (cp.ranks[(cp.rank + shift) % cp.size] for shift in (1, -1))
        self.handles = comm.batch_isend_irecv([(self.sent, following, tag)],
                                              [(self.received, preceding, tag)], cp)

    def wait(self) -> torch.Tensor:
        for handle in self.handles:
            handle.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, options, dropout, rng, documents):
        mine = Queries.of(q, cp, options, dropout, rng, documents)
        out, lse = [None, None], [None, None]
        held = torch.stack([k, v])  # one message per step
        for step, source in enumerate(sources(cp.size, cp.rank)):
            pending = _Transfer(held, cp, KV) if step + 1 < cp.size else None
            mine.forward(q, source, held[0], held[1], out, lse)
            if pending is not None:
                held = pending.wait()
        result = torch.cat(out, dim=3).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=3))
        ctx.cp, ctx.mine = cp, mine
        return result

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, result, lse = ctx.saved_tensors
        cp, mine = ctx.cp, ctx.mine
        grad_output, delta, grad_q, keeps = mine.start_backward(q, grad_output, result)
        held, arriving = torch.stack([k, v]), None
        for step, source in enumerate(sources(cp.size, cp.rank)):
            pending = _Transfer(held, cp, KV) if step + 1 < cp.size else None
            grad_kv = mine.backward(q, source, held[0], held[1], grad_output, result, lse, delta, grad_q,
                                    keeps)
            if arriving is not None:  # what the ranks before this one added to the block held now
                grad_kv += arriving.wait()
            arriving = _Transfer(grad_kv, cp, GRAD_KV)
            if pending is not None:
                held = pending.wait()
        grad_kv = arriving.wait()  # this rank's own block, back from its round
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: AxisGroup, options: ScoreOptions,
                   dropout: float = 0.0, rng=None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries on the whole sequence's keys and values, q [b, G, Q, s, d]
    and k, v [b, G, s, d] in the rank's zig-zag order (s = S / cp), scored as ``options`` say (scale,
    sliding window, soft-capping); ``documents`` [b, S]: the document of every token of the whole
    sequence (attention stays within one); ``rng``: the tracker whose stream draws attention dropout (per
    cp rank). Returns [b, G, Q, s, d]."""
    return _RingAttention.apply(q, k, v, cp, options, dropout, rng, documents)
