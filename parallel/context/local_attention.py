"""Attention over keys this rank holds in full: which keys a query sees, and the kernel that runs it.

Used wherever a rank has every key its queries need: a model without context parallelism, Ulysses
(whole sequences, a share of the heads) and all-gather attention (the gathered keys). Visibility is
decided from global token indices, so a query sees the same keys whatever the layout: causal, within
a sliding window (keys i - W + 1 .. i, transformers' ``sliding_window``), within its document.
Without soft-capping the kernel is torch's scaled_dot_product_attention (causal without a mask, the
fused path); with it the scores are formed explicitly, capped as C tanh(s / C), masked and softmaxed
in fp32, as transformers' eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ScoreOptions:
    """How one layer turns queries and keys into attention weights: ``scale`` (the scores' factor),
    ``window`` (keys a query sees, itself included; None: the whole past), ``softcap`` (C of
    C tanh(s / C); None: none). Owns no tensor."""

    scale: float
    window: int | None = None
    softcap: float | None = None

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` soft-capped (unchanged without a cap)."""
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap


def visible(query_index: torch.Tensor, key_index: torch.Tensor, window: int | None = None,
            documents: torch.Tensor | None = None) -> torch.Tensor:
    """[b or 1, 1, s, t] bool, True where query ``query_index[i]`` sees key ``key_index[j]`` (global token
    indices): at or before it, within ``window`` tokens, in its document (``documents`` [b, S], each
    token's document over the whole sequence)."""
    difference = query_index[:, None] - key_index[None, :]
    mask = difference >= 0
    if window is not None:
        mask = mask & (difference < window)
    if documents is not None:
        mask = mask & (documents[:, query_index, None] == documents[:, None, key_index])
    return mask.view(-1, 1, len(query_index), len(key_index))


def sequence_mask(length: int, window: int | None, documents: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor | None:
    """The mask of a whole sequence of ``length`` tokens attending to itself; None when plain causal."""
    if window is None and documents is None:
        return None
    index = torch.arange(length, device=device)
    return visible(index, index, window, documents)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: ScoreOptions,
           mask: torch.Tensor | None, dropout: float = 0.0) -> torch.Tensor:
    """softmax(capped(q k^T scale) | mask) v: q [b, H, s, d], k and v [b, G, t, d] (H a multiple of G),
    ``mask`` [b or 1, 1, s, t] (None: causal, s = t). Dropout draws from the current stream (the caller
    forks it). Returns [b, H, s, d]."""
    heads, groups = q.shape[1], k.shape[1]
    if options.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=dropout, scale=options.scale,
                                              enable_gqa=heads > groups)
    b, _, s, d = q.shape
    grouped = q.view(b, groups, heads // groups, s, d)
    scores = options.capped(torch.einsum("bgqsd,bgtd->bgqst", grouped, k) * options.scale)
    if mask is None:
        mask = torch.ones(1, 1, s, k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return torch.einsum("bgqst,bgtd->bgqsd", probs, v).reshape(b, heads, s, d)
