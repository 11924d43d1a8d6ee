"""Ulysses attention (``--cp-comm-type a2a``): from sequence sharding to head sharding and back.

One all-to-all turns q, k, v [b, G, ..., S/cp, d] (every key/value group, this rank's tokens) into
[b, G/cp, ..., S, d] (G/cp groups, every token, in natural order); attention then runs on whole
sequences, and a second all-to-all returns the output to sequence sharding. Each rank sends
(cp - 1)/cp of q, k, v and the output per layer (DeepSpeed's 4Nh/P per link). Key/value groups (and so
query heads) must divide by cp. Backward is the same all-to-alls in reverse.
"""

from __future__ import annotations

import contextlib

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.context.local_attention import ScoreOptions, attend, sequence_mask


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


def _to_heads(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, G, ..., s, d] in this rank's zig-zag order -> [b, G/cp, ..., S, d] in natural order."""
    n = cp.size
    parts = x.unflatten(1, (n, x.shape[1] // n)).movedim(1, 0)
    received = _SwapParts.apply(parts, cp)  # [source rank, b, G/cp, ..., s, d]
    first, second = received.chunk(2, dim=-2)  # the source's chunks i and 2cp-1-i
    return torch.cat([first[c] if c < n else second[2 * n - 1 - c] for c in range(2 * n)], dim=-2)


def _to_sequence(y: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """The inverse of ``_to_heads``."""
    n = cp.size
    chunks = y.chunk(2 * n, dim=-2)
    parts = torch.stack([torch.cat([chunks[j], chunks[2 * n - 1 - j]], dim=-2) for j in range(n)])
    return _SwapParts.apply(parts, cp).movedim(0, 1).flatten(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: AxisGroup, options: ScoreOptions,
                      dropout: float = 0.0, rng=None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence, q [b, G, Q, s, d] and k, v [b, G, s, d] in this rank's
    zig-zag order, scored as ``options`` say (scale, sliding window, soft-capping); ``documents`` [b, S]:
    attention stays within a document. Returns [b, G, Q, s, d]."""
    if k.shape[1] % cp.size:
        raise ValueError(f"--cp-comm-type a2a: {k.shape[1]} key/value groups per tensor-parallel rank do not "
                         f"divide by --context-parallel-size {cp.size}")
    heads_q, heads_k, heads_v = (_to_heads(t, cp) for t in (q, k, v))
    b, groups, queries, length, d = heads_q.shape
    mask = sequence_mask(length, options.window, documents, q.device)
    with rng.fork() if rng is not None and dropout > 0 else contextlib.nullcontext():
        out = attend(heads_q.flatten(1, 2), heads_k, heads_v, options, mask, dropout)
    return _to_sequence(out.view(b, groups, queries, length, d), cp)
