"""Attention over a sequence cut across the context-parallel group, one of three ways per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import AxisGroup, compile_boundary
from parallel.context.allgather_attention import allgather_attention
from parallel.context.local_attention import ScoreOptions
from parallel.context.ring_attention import ring_attention
from parallel.context.ulysses_attention import ulysses_attention

COMM_TYPES = ("p2p", "a2a", "allgather")


@dataclass(frozen=True)
class ContextParallel:
    """The cp group a model's attention talks over, and how each layer does (``--cp-comm-type``: one
    value for every layer, or one per layer). Owns no tensor; never cuts data (``sharding`` does)."""

    group: AxisGroup
    comm_types: tuple[str, ...] = ("p2p",)

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.comm_types if kind not in COMM_TYPES]
        if unknown or not self.comm_types:
            raise ValueError(f"--cp-comm-type {' '.join(self.comm_types)}: choose from "
                             f"{', '.join(COMM_TYPES)}")

    @property
    def size(self) -> int:
        return self.group.size

    def comm_type(self, layer: int) -> str:
        """How global layer ``layer`` exchanges keys and values."""
        return self.comm_types[layer] if len(self.comm_types) > 1 else self.comm_types[0]


@compile_boundary  # it exchanges keys and values over the cp group
def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ContextParallel, layer: int,
                      options: ScoreOptions, dropout: float = 0.0, rng=None,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [b, H, s, d] on k, v [b, G, s, d] (H a multiple of G; s = S / cp tokens in this
    rank's zig-zag order) as if the whole sequence were here, scored as ``options`` say (scale, sliding
    window, soft-capping); ``documents`` [b, S]: each token's document over the whole sequence, attention
    staying within one. Returns [b, H, s, d]."""
    b, heads, length, d = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], length, d)
    attention = {"p2p": ring_attention, "a2a": ulysses_attention,
                 "allgather": allgather_attention}[context.comm_type(layer)]
    out = attention(grouped, k, v, context.group, options, dropout, rng, documents)
    return out.reshape(b, heads, length, d)
