"""Attention of one block of queries on one block of keys and values, exactly, with its log-sum-exp.

The unit ring attention is built from: a rank's queries meet the key/value blocks of every cp rank
one at a time, and the partial results merge exactly (``merge``) because each carries the log of its
softmax denominator. Shapes, grouped queries kept apart from their key/value group (no copy of K/V
per head): q [b, G, Q, s, d], k and v [b, G, t, d], out [b, G, Q, s, d], lse [b, G, Q, s]. Computed in
fp32 whatever the inputs' dtype. ``mask`` (bool, True = visible) broadcasts to [b, 1, 1, s, t]; None
means every key is visible. ``keep``: attention dropout's mask of kept probabilities, [b, G, Q, s, t].
"""

from __future__ import annotations

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    scores = torch.einsum("bgqsd,bgtd->bgqst", q.float(), k.float()) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key (-inf) at 0, so exp(score - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
            keep: torch.Tensor | None, dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(q k^T scale) v over this block's keys; rows that see none give 0 and -inf."""
    scores = _scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1.0 - dropout)
    return torch.einsum("bgqst,bgtd->bgqsd", probs, v.float()), lse


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
             keep: torch.Tensor | None, dropout: float, grad_out: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block's share, given the merged output's gradient ``grad_out``, the merged
    ``lse`` and ``delta`` = rowsum(grad_out * merged out) (the softmax backward's correction)."""
    probs = torch.exp(_scores(q, k, scale, mask) - _finite(lse).unsqueeze(-1))
    dropped = probs if keep is None else probs * keep / (1.0 - dropout)
    grad_v = torch.einsum("bgqst,bgqsd->bgtd", dropped, grad_out)
    grad_probs = torch.einsum("bgqsd,bgtd->bgqst", grad_out, v.float())
    if keep is not None:
        grad_probs = grad_probs * keep / (1.0 - dropout)
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    grad_q = torch.einsum("bgqst,bgtd->bgqsd", grad_scores, k.float()) * scale
    grad_k = torch.einsum("bgqst,bgqsd->bgtd", grad_scores, q.float()) * scale
    return grad_q, grad_k, grad_v


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact combination of two partial attentions over disjoint key sets (None: nothing yet)."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    weight, block_weight = torch.exp(lse - safe), torch.exp(block_lse - safe)
    return out * weight.unsqueeze(-1) + block_out * block_weight.unsqueeze(-1), merged
