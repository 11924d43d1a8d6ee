"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel the cp ring, never gathered.

Each rank starts with its own K/V (its two zig-zag chunks) and, in cp steps, meets every rank's: at
each step it posts the send of the block it holds to the next rank and the receive of the previous
rank's (one batch of isend/irecv, the NCCL-safe pairing the pipeline uses), computes attention on the
block it holds while that transfer runs, and merges the partial result exactly by its log-sum-exp.
Causal masking is per chunk pair: a query chunk sees an earlier key chunk whole, its own chunk
causally, a later one not at all (the work skipped); a sliding window cuts the pairs it crosses and
skips those wholly behind it. Backward sends the K/V blocks round again and, one
step behind them, the fp32 dK/dV accumulators, which arrive back at their owner after the last step.
A rank holds at most its own block, the one in flight and one accumulator: never the whole sequence.
"""

from __future__ import annotations

import contextlib

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.context import block_attention as block
from parallel.context.local_attention import ScoreOptions, visible
from parallel.context.sharding import chunk_ids

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


def _pairs(queries: tuple[int, int], keys: tuple[int, int], length: int, window: int | None,
           documents: torch.Tensor | None, device: torch.device):
    """(query half, key half, diagonal, mask) for every pair of chunks in which some query sees some key:
    causal on the diagonal, whole below it, skipped above it and beyond the window. ``mask``
    ([b or 1, 1, 1, s, t]) only where the pair is cut by the documents ([b, S]) or the window, else None
    (whole, or plain causal on the diagonal)."""
    offsets = torch.arange(length, device=device)
    for a, query_chunk in enumerate(queries):
        for b, key_chunk in enumerate(keys):
            distance = (query_chunk - key_chunk) * length  # between the pair's first tokens
            nearest, farthest = distance - (length - 1), distance + (length - 1)
            if query_chunk < key_chunk or (window is not None and nearest >= window):
                continue
            mask = None
            if documents is not None or (window is not None and farthest >= window):
                mask = visible(query_chunk * length + offsets, key_chunk * length + offsets, window,
                               documents).unsqueeze(2)
            yield a, b, query_chunk == key_chunk, mask


def _explicit_mask(diagonal: bool, mask: torch.Tensor | None, causal: torch.Tensor) -> torch.Tensor | None:
    """The mask of the explicit form: the pair's own, else the causal one on the diagonal, else none."""
    return causal if mask is None and diagonal else mask


def _block_forward(q, k, v, options, diagonal, mask, keep, dropout, causal):
    if block.fused(q, options, mask is None, keep):
        return block.fused_forward(q, k, v, options.scale, diagonal)
    return block.forward(q, k, v, options, _explicit_mask(diagonal, mask, causal), keep, dropout)


def _block_backward(q, k, v, options, diagonal, mask, keep, dropout, grad_out, out, lse, delta, causal):
    if block.fused(q, options, mask is None, keep):
        return block.fused_backward(q, k, v, options.scale, diagonal, grad_out, out, lse)
    return block.backward(q, k, v, options, _explicit_mask(diagonal, mask, causal), keep, dropout,
                          grad_out.float(), lse, delta)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, options, dropout, rng, documents):
        n, mine = cp.size, chunk_ids(cp.size, cp.rank)
        length = q.shape[3] // 2
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        queries = q.split(length, dim=3)
        out, lse, keeps = [None, None], [None, None], []
        held = torch.stack([k, v])  # one message per step
        for step in range(n):
            pending = _Transfer(held, cp, KV) if step + 1 < n else None
            keys, values = held[0].split(length, dim=2), held[1].split(length, dim=2)
            for a, b, diagonal, mask in _pairs(mine, chunk_ids(n, (cp.rank - step) % n), length,
                                               options.window, documents, q.device):
                keep = None
                if dropout > 0:
                    with rng.fork() if rng is not None else contextlib.nullcontext():
                        keep = torch.rand(queries[a].shape[:4] + (length,), device=q.device) >= dropout
                keeps.append(keep)
                part, part_lse = _block_forward(queries[a], keys[b], values[b], options, diagonal, mask,
                                                keep, dropout, causal)
                out[a], lse[a] = block.merge(out[a], lse[a], part, part_lse)
            if pending is not None:
                held = pending.wait()
        result = torch.cat(out, dim=3).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=3))
        ctx.cp, ctx.options, ctx.dropout, ctx.keeps, ctx.documents = cp, options, dropout, keeps, documents
        return result

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, result, lse = ctx.saved_tensors
        cp, options, dropout, documents = ctx.cp, ctx.options, ctx.dropout, ctx.documents
        n, mine = cp.size, chunk_ids(cp.size, cp.rank)
        length = q.shape[3] // 2
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        grad_output = grad_output.to(q.dtype)
        delta = (grad_output.float() * result.float()).sum(-1)
        queries, grads, outs, lses, deltas = (t.split(length, dim=3)
                                              for t in (q, grad_output, result, lse, delta))
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_queries = grad_q.split(length, dim=3)
        keeps = iter(ctx.keeps)
        held, arriving = torch.stack([k, v]), None
        for step in range(n):
            pending = _Transfer(held, cp, KV) if step + 1 < n else None
            keys, values = held[0].split(length, dim=2), held[1].split(length, dim=2)
            grad_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            grad_keys, grad_values = grad_kv[0].split(length, dim=2), grad_kv[1].split(length, dim=2)
            for a, b, diagonal, mask in _pairs(mine, chunk_ids(n, (cp.rank - step) % n), length,
                                               options.window, documents, q.device):
                dq, dk, dv = _block_backward(queries[a], keys[b], values[b], options, diagonal, mask,
                                             next(keeps), dropout, grads[a], outs[a], lses[a], deltas[a],
                                             causal)
                grad_queries[a].add_(dq)
                grad_keys[b].add_(dk)
                grad_values[b].add_(dv)
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
