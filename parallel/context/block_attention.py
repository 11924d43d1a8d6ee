"""Attention of one block of queries on one block of keys and values, exactly, with its log-sum-exp.

The unit ring attention is built from: a rank's queries meet the key/value blocks of every cp rank
one at a time, and the partial results merge exactly (``merge``) because each carries the log of its
softmax denominator. Shapes, grouped queries kept apart from their key/value group (no copy of K/V
per head): q [b, G, Q, s, d], k and v [b, G, t, d], out [b, G, Q, s, d], lse [b, G, Q, s]. Computed in
fp32 whatever the inputs' dtype, soft-capped where the layer's ``ScoreOptions`` say. ``mask``
(bool, True = visible) broadcasts to [b, 1, 1, s, t]; None means every key is visible. ``keep``:
attention dropout's mask of kept probabilities, [b, G, Q, s, t].

``fused_forward`` / ``fused_backward`` are the same on torch's fused CPU kernel (flash attention for
the CPU, which returns the log-sum-exp and whose backward takes the merged output and log-sum-exp, as
ring attention needs), for blocks that are whole or causal on the diagonal, without dropout or
soft-capping. On other
devices the blocks run on the explicit form above (no fused kernel for accelerators is wired here).
"""

from __future__ import annotations

import torch

from parallel.context.local_attention import ScoreOptions


def _scores(q: torch.Tensor, k: torch.Tensor, options: ScoreOptions) -> torch.Tensor:
    """The block's soft-capped scores in fp32, before masking."""
    return options.capped(torch.einsum("bgqsd,bgtd->bgqst", q.float(), k.float()) * options.scale)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key (-inf) at 0, so exp(score - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: ScoreOptions,
            mask: torch.Tensor | None, keep: torch.Tensor | None,
            dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(capped(q k^T scale)) v over this block's keys; rows that see none give 0 and
    -inf."""
    scores = _masked(_scores(q, k, options), mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1.0 - dropout)
    return torch.einsum("bgqst,bgtd->bgqsd", probs, v.float()), lse


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: ScoreOptions,
             mask: torch.Tensor | None, keep: torch.Tensor | None, dropout: float, grad_out: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block's share, given the merged output's gradient ``grad_out``, the merged
    ``lse`` and ``delta`` = rowsum(grad_out * merged out) (the softmax backward's correction)."""
    scores = _scores(q, k, options)
    probs = torch.exp(_masked(scores, mask) - _finite(lse).unsqueeze(-1))
    dropped = probs if keep is None else probs * keep / (1.0 - dropout)
    grad_v = torch.einsum("bgqst,bgqsd->bgtd", dropped, grad_out)
    grad_probs = torch.einsum("bgqsd,bgtd->bgqst", grad_out, v.float())
    if keep is not None:
        grad_probs = grad_probs * keep / (1.0 - dropout)
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    if options.softcap is not None:  # d(C tanh(s / C)) / ds = 1 - tanh^2, from the unmasked capped scores
        grad_scores = grad_scores * (1 - (scores / options.softcap).square())
    grad_q = torch.einsum("bgqst,bgtd->bgqsd", grad_scores, k.float()) * options.scale
    grad_k = torch.einsum("bgqst,bgqsd->bgtd", grad_scores, q.float()) * options.scale
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


def fused(q: torch.Tensor, options: ScoreOptions, mask_free: bool, keep: torch.Tensor | None) -> bool:
    """Whether a block runs on the fused CPU kernel: on the CPU, no document or window mask, no dropout,
    no soft-capping."""
    return q.device.type == "cpu" and mask_free and keep is None and options.softcap is None


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q as [b, G Q, s, d]; k and v repeated for a group's Q queries (the kernel takes equal heads)."""
    b, groups, queries, length, d = q.shape
    def each(t):
        return t.unsqueeze(2).expand(b, groups, queries, t.shape[2], d).reshape(b, groups * queries, -1, d)
    return q.reshape(b, groups * queries, length, d), each(k), each(v)


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` of a whole (``causal`` False) or diagonal block on torch's flash kernel for the CPU."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_heads(q, k, v), 0.0, causal,
                                                                         scale=scale)
    return out.view(q.shape).float(), lse.reshape(q.shape[:4])


def fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   grad_out: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward`` on the fused kernel: ``grad_out`` and the merged ``out`` in q's dtype, merged ``lse``."""
    b, groups, queries, length, d = q.shape
    heads = _heads(q, k, v)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.reshape(heads[0].shape), *heads, out.reshape(heads[0].shape),
        lse.reshape(b, groups * queries, length), 0.0, causal, scale=scale)
    grad_q, grad_k, grad_v = (g.float() for g in grads)
    return (grad_q.view(q.shape), grad_k.view(b, groups, queries, -1, d).sum(2),
            grad_v.view(b, groups, queries, -1, d).sum(2))
