"""Attention over keys this rank holds in full: which keys a query sees, and the kernel that runs it.

Used wherever a rank has every key its queries need: a model without context parallelism, Ulysses
(whole sequences, a share of the heads) and all-gather attention (the gathered keys). Visibility is
decided from global token indices, so a query sees the same keys whatever the layout: causal, within
a sliding window (keys i - W + 1 .. i, transformers' ``sliding_window``), within its document.
Without soft-capping or sinks the kernel is torch's scaled_dot_product_attention (causal without a mask,
the fused path); with either the scores are formed explicitly, capped as C tanh(s / C), masked and
softmaxed in fp32, as transformers' eager attention does. An attention sink (Megatron's --softmax-type
off-by-one or learnable, gpt-oss's ``sinks``) is one more logit per head in each query's softmax, with
no value: p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)).
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


class _SinkSoftmax(torch.autograd.Function):
    """softmax over each row of ``scores`` [b, G, H/G, s, t] (fp32, -inf where masked) and its head's sink
    logit ``sink`` [1, G, H/G, 1, 1], the sink's own probability left out. Keeps only the probabilities
    (those of the sink too, a column), as torch's softmax keeps its output."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)  # finite even where all is masked
        exponents = torch.exp(scores - top)
        sunk = torch.exp(sink - top)
        total = exponents.sum(dim=-1, keepdim=True) + sunk
        probs, sunk = exponents.div_(total), sunk / total
        ctx.save_for_backward(probs, sunk)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, sunk = ctx.saved_tensors
        expected = (grad * probs).sum(dim=-1, keepdim=True)  # the sink's own gradient is 0
        grad_sink = (-sunk * expected).sum(dim=(0, 3), keepdim=True)
        return probs * (grad - expected), grad_sink


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: ScoreOptions,
           mask: torch.Tensor | None, dropout: float = 0.0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(capped(q k^T scale) | mask) v: q [b, H, s, d], k [b, G, t, d] and v [b, G, t, e] (H a
    multiple of G), ``mask`` [b or 1, 1, s, t] (None: causal, s = t), ``sinks`` [H] the heads' sink logits
    (None: no sink). Dropout draws from the current stream (the caller forks it). Returns [b, H, s, e]."""
    heads, groups = q.shape[1], k.shape[1]
    if options.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=dropout, scale=options.scale,
                                              enable_gqa=heads > groups)
    b, _, s, d = q.shape
    grouped = q.view(b, groups, heads // groups, s, d)
    scores = options.capped(torch.einsum("bgqsd,bgtd->bgqst", grouped, k) * options.scale).float()
    if mask is None:
        mask = torch.ones(1, 1, s, k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _SinkSoftmax.apply(scores, sinks.float().view(1, groups, heads // groups, 1, 1))
    probs = probs.to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return torch.einsum("bgqst,bgtd->bgqsd", probs, v).reshape(b, heads, s, v.shape[-1])
