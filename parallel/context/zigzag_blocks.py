"""This rank's queries against one cp rank's key/value block, chunk pair by chunk pair: the step that ring
attention takes once per block passed round the ring and all-gather attention once per gathered block.

A rank holds two zig-zag chunks (``sharding``). Causal masking is per chunk pair: a query chunk sees an
earlier key chunk whole, its own chunk causally, a later one not at all (the work skipped); a sliding
window cuts the pairs it crosses and skips those wholly behind it. Each pair's partial result merges
exactly by its log-sum-exp (``block_attention``); backward takes the merged output and log-sum-exp, so no
pair's forward is computed twice. ``Queries`` holds what a rank's forward builds and backward reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from parallel.context import block_attention as block
from parallel.context.local_attention import ScoreOptions, visible
from parallel.context.sharding import chunk_ids


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


@dataclass
class Queries:
    """How this rank's queries q [b, G, Q, 2 chunks, d] (chunks of ``length`` tokens, on ``device``) meet the
    key/value blocks of the cp ranks, as cp rank ``rank`` of ``cp`` (attention dropout drawn from ``rng``'s
    stream in the order the blocks are met), and what its forward keeps for backward: the dropout masks, in
    that order. Holds no tensor of the attention's (autograd keeps q); never communicates."""

    length: int
    device: torch.device
    cp: int
    rank: int
    options: ScoreOptions
    dropout: float = 0.0
    rng: object | None = None
    documents: torch.Tensor | None = None
    keeps: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mine = chunk_ids(self.cp, self.rank)
        self.causal = torch.ones(self.length, self.length, dtype=torch.bool, device=self.device).tril()

    @classmethod
    def of(cls, q: torch.Tensor, cp, options: ScoreOptions, dropout: float, rng,
           documents: torch.Tensor | None) -> Queries:
        """The meeting of ``q`` with the blocks of the cp group ``cp``."""
        return cls(q.shape[3] // 2, q.device, cp.size, cp.rank, options, dropout, rng, documents)

    def _pairs(self, source: int):
        return _pairs(self.mine, chunk_ids(self.cp, source), self.length, self.options.window, self.documents,
                      self.device)

    def forward(self, q: torch.Tensor, source: int, k: torch.Tensor, v: torch.Tensor, out: list,
                lse: list) -> None:
        """Attend with ``q`` to cp rank ``source``'s block k, v [b, G, 2 chunks, d], merging into ``out`` /
        ``lse`` (one entry per query chunk, None before any)."""
        options = self.options
        queries = q.split(self.length, dim=3)
        keys, values = k.split(self.length, dim=2), v.split(self.length, dim=2)
        for a, b, diagonal, mask in self._pairs(source):
            keep = None
            if self.dropout > 0:
                with self.rng.fork() if self.rng is not None else contextlib.nullcontext():
                    keep = torch.rand(queries[a].shape[:4] + (self.length,), device=self.device)
                keep = keep >= self.dropout
            self.keeps.append(keep)
            if block.fused(queries[a], options, mask is None, keep):
                part, part_lse = block.fused_forward(queries[a], keys[b], values[b], options.scale,
                                                     diagonal)
            else:
                part, part_lse = block.forward(queries[a], keys[b], values[b], options,
                                               _explicit_mask(diagonal, mask, self.causal), keep,
                                               self.dropout)
            out[a], lse[a] = block.merge(out[a], lse[a], part, part_lse)

    def start_backward(self, q: torch.Tensor, grad_output: torch.Tensor, result: torch.Tensor):
        """(grad_output in q's dtype, delta, the fp32 dq accumulator, the forward's dropout masks in order)
        for the backward of the forward that gave ``result`` from ``q``."""
        grad_output = grad_output.to(q.dtype)
        delta = (grad_output.float() * result.float()).sum(-1)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        return grad_output, delta, grad_q, iter(self.keeps)

    def backward(self, q: torch.Tensor, source: int, k: torch.Tensor, v: torch.Tensor,
                 grad_output: torch.Tensor, result: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                 grad_q: torch.Tensor, keeps) -> torch.Tensor:
        """Source ``source``'s share of the gradients, given the merged ``result``, ``lse`` and ``delta`` =
        rowsum(grad_output * result): dq added into ``grad_q`` (fp32), the block's fp32 dK/dV returned
        [2, *k.shape]; ``keeps``: the forward's masks, met in the same order."""
        length, options, dropout = self.length, self.options, self.dropout
        queries, grads, outs, lses, deltas = (t.split(length, dim=3)
                                              for t in (q, grad_output, result, lse, delta))
        grad_queries = grad_q.split(length, dim=3)
        keys, values = k.split(length, dim=2), v.split(length, dim=2)
        grad_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        grad_keys, grad_values = grad_kv[0].split(length, dim=2), grad_kv[1].split(length, dim=2)
        for a, b, diagonal, mask in self._pairs(source):
            keep = next(keeps)
            if block.fused(queries[a], options, mask is None, keep):
                dq, dk, dv = block.fused_backward(queries[a], keys[b], values[b], options.scale, diagonal,
                                                  grads[a], outs[a], lses[a])
            else:
                dq, dk, dv = block.backward(queries[a], keys[b], values[b], options,
                                            _explicit_mask(diagonal, mask, self.causal), keep, dropout,
                                            grads[a].float(), lses[a], deltas[a])
            grad_queries[a].add_(dq)
            grad_keys[b].add_(dk)
            grad_values[b].add_(dv)
        return grad_kv


def sources(cp: int, rank: int) -> list[int]:
    """The cp ranks whose blocks a rank meets, in order: its own, then each ring predecessor's."""
    return [(rank - step) % cp for step in range(cp)]
