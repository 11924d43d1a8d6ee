"""Cross entropy over logits split by vocabulary range across the tensor-parallel group.

No rank ever materialises the full [s, b, vocab] logits: each step below works on this rank's
[s, b, vocab/tp] shard, and only [s, b] tensors cross the group.

Memory: the shard is never copied whole. The max is taken in the logits' own dtype (exact); the
exponentials, their sum and, in backward, the softmax are made in fp32 for ``CHUNK_ELEMENTS`` entries
(rows of tokens) at a time, so a bf16 run's fp32 temporaries are one chunk, not the vocabulary times the
tokens. What backward keeps is the logits themselves and the [s, b] max and sum; it writes the gradient
chunk by chunk into one buffer of the logits' dtype. Each token's numbers come from the same operations
on its row in whatever chunk it falls: the chunking never changes a value.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup, compile_boundary

CHUNK_ELEMENTS = 1 << 26  # fp32 entries made at once (256 MiB): the loss's largest temporary


def _chunks(rows: int, width: int, chunk_elements: int):
    step = max(1, chunk_elements // max(width, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _shifted(flat: torch.Tensor, start: int, end: int, valid: int, logits_max: torch.Tensor) -> torch.Tensor:
    """Rows ``[start, end)`` of the valid logits minus their global max, in a new buffer of the max's
    (at least fp32) dtype: ``flat`` is never written."""
    return flat[start:end, :valid].to(logits_max.dtype, copy=True).sub_(logits_max[start:end].unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_vocab, group, chunk_elements):
        width = logits.shape[-1]
        valid = max(min(valid_vocab - vocab_start, width), 0)  # padded entries (ids >= valid_vocab) take none
        flat, wide = logits.reshape(-1, width), torch.promote_types(logits.dtype, torch.float32)
        logits_max = (flat[:, :valid].amax(dim=-1) if valid else flat.new_full(flat.shape[:1], float("-inf")))
        logits_max = logits_max.to(wide)
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        # the target's logit, from the one rank whose range holds it
        outside = ((target < vocab_start) | (target >= vocab_start + width)).reshape(-1)
        local_target = (target.reshape(-1) - vocab_start).masked_fill(outside, 0)
        target_logit = (flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(wide) - logits_max)
        target_logit = target_logit.masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)
        sum_exp = torch.empty_like(logits_max)
        for start, end in _chunks(flat.shape[0], valid, chunk_elements):
            sum_exp[start:end] = _shifted(flat, start, end, valid, logits_max).exp_().sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        ctx.valid, ctx.chunk_elements = valid, chunk_elements
        ctx.save_for_backward(logits, local_target, outside, logits_max, sum_exp)
        return (sum_exp.log() - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, outside, logits_max, sum_exp = ctx.saved_tensors
        width, valid = logits.shape[-1], ctx.valid
        flat = logits.reshape(-1, width)
        grad = torch.zeros_like(flat) if valid < width else torch.empty_like(flat)  # padded entries: 0
        scale = grad_loss.reshape(-1).to(sum_exp.dtype)
        inside = (~outside).to(sum_exp.dtype)
        for start, end in _chunks(flat.shape[0], valid, ctx.chunk_elements) if valid else ():  # all padding
            # d loss / d logits = (softmax - one_hot(target)) x the loss's gradient, the one-hot only on the
            # owning rank
            softmax = _shifted(flat, start, end, valid, logits_max).exp_()
            softmax.div_(sum_exp[start:end].unsqueeze(-1))
            softmax.scatter_add_(-1, local_target[start:end].unsqueeze(-1),
                                 -inside[start:end].unsqueeze(-1))
            grad[start:end, :valid] = softmax.mul_(scale[start:end].unsqueeze(-1))
        return grad.view(logits.shape), None, None, None, None, None


# its all-reduces over tp end a compiled region; at tp = 1 it has none, and compiles with the loss head
_cross_entropy = compile_boundary(_VocabParallelCrossEntropy.apply)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: AxisGroup,
                                 valid_vocab: int | None = None,
                                 chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logits shard [s, b, vocab/tp] and global target ids.

    ``valid_vocab`` (the tokenizer's vocabulary) excludes padded entries from the softmax;
    ``chunk_elements``: the fp32 entries made at once.
    """
    width = logits_shard.shape[-1]
    vocab_start = group.rank * width
    valid_vocab = width * group.size if valid_vocab is None else valid_vocab
    cross_entropy = _VocabParallelCrossEntropy.apply if group.size == 1 else _cross_entropy
    return cross_entropy(logits_shard, target, vocab_start, valid_vocab, group, chunk_elements)
