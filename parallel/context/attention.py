"""Attention over a sequence cut across the context-parallel group, one of three ways per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import AxisGroup
from parallel.context.allgather_attention import allgather_attention
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


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """[b, 1, S, S] bool: token i sees token j <= i of its own document (``documents`` [b, S] numbers each
    token's document)."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ContextParallel, layer: int,
                      dropout: float = 0.0, rng=None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [b, H, s, d] on k, v [b, G, s, d] (H a multiple of G; s = S / cp tokens in this
    rank's zig-zag order) as if the whole sequence were here; ``documents`` [b, S]: each token's document
    over the whole sequence, attention staying within one. Returns [b, H, s, d]."""
    b, heads, length, d = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], length, d)
    scale = d ** -0.5
    kind = context.comm_type(layer)
    if kind == "p2p":
        out = ring_attention(grouped, k, v, context.group, scale, dropout, rng, documents)
    elif kind == "a2a":
        mask = document_mask(documents) if documents is not None else None
        out = ulysses_attention(grouped, k, v, context.group, scale, dropout, rng, mask)
    else:
        out = allgather_attention(grouped, k, v, context.group, scale, dropout, rng, documents)
    return out.reshape(b, heads, length, d)
