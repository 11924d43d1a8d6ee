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

from parallel.comm import AxisGroup
from parallel.context.head_exchange import to_heads, to_sequence
from parallel.context.local_attention import ScoreOptions, attend, sequence_mask


def _to_heads(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, G, ..., s, d] in this rank's zig-zag order -> [b, G/cp, ..., S, d] in natural order."""
    return to_heads(x.unflatten(1, (cp.size, x.shape[1] // cp.size)).movedim(1, 0), cp)


def _to_sequence(y: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """The inverse of ``_to_heads``."""
    return to_sequence(y, cp).movedim(0, 1).flatten(1, 2)


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
