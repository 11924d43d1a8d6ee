"""Cross entropy over logits split by vocabulary range across the tensor-parallel group.

No rank ever materialises the full [s, b, vocab] logits: each step below works on this rank's
[s, b, vocab/tp] shard, and only [s, b] tensors cross the group.

Memory: forward makes one fp32 [s, b, vocab/tp] buffer and works in it in place (mask, shift, exp).
For fp32 logits that buffer becomes the softmax saved for backward. For bf16 / fp16 logits it is freed
at the end of forward: backward recomputes the softmax from the 16-bit logits (saved instead, half the
bytes) and the saved [s, b] max and sum, with the same operations, so the gradient is bit for bit the
one the saved softmax would give.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup, compile_boundary


_LOW_PRECISION = {torch.bfloat16: torch.float32, torch.float16: torch.float32}  # reduced in fp32


def _shifted(logits: torch.Tensor, vocab_start: int, valid_vocab: int, logits_max: torch.Tensor | None,
                 group: AxisGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """logits - global max in one buffer of at least fp32 (a copy: ``logits`` is never written), and the
    max."""
    width = logits.shape[-1]
    values = logits.to(_LOW_PRECISION.get(logits.dtype, logits.dtype), copy=True)
    # padded vocabulary entries (ids >= valid_vocab) take no probability
    if vocab_start + width > valid_vocab:
        values[..., max(valid_vocab - vocab_start, 0):] = float("-inf")
    if logits_max is None:
        logits_max = values.max(dim=-1).values
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
    return values.sub_(logits_max.unsqueeze(-1)), logits_max


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_vocab, group):
        width = logits.shape[-1]
        shifted, logits_max = _shifted(logits, vocab_start, valid_vocab, None, group)
        # the target's logit, from the one rank whose range holds it
        outside = (target < vocab_start) | (target >= vocab_start + width)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit
        ctx.vocab, ctx.group = (vocab_start, valid_vocab), group
        if logits.dtype not in _LOW_PRECISION:
            ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        else:
            ctx.save_for_backward(logits, local_target, outside, logits_max, sum_exp)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # turns the softmax into the gradient in place (no second [s, b, v/tp] buffer), so this graph
        # supports one backward only (no retain_graph), as in Megatron
        if len(ctx.saved_tensors) == 3:
            softmax, local_target, outside = ctx.saved_tensors
        else:
            logits, local_target, outside, logits_max, sum_exp = ctx.saved_tensors
            softmax = _shifted(logits, *ctx.vocab, logits_max,
                               ctx.group)[0].exp_().div_(sum_exp.unsqueeze(-1))
        # d loss / d logits = softmax - one_hot(target), the one-hot only on the owning rank
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None


# its all-reduces over tp end a compiled region; at tp = 1 it has none, and compiles with the loss head
_cross_entropy = compile_boundary(_VocabParallelCrossEntropy.apply)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: AxisGroup,
                                 valid_vocab: int | None = None) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logits shard [s, b, vocab/tp] and global target ids.

    ``valid_vocab`` (the tokenizer's vocabulary) excludes padded entries from the softmax.
    """
    width = logits_shard.shape[-1]
    vocab_start = group.rank * width
    valid_vocab = width * group.size if valid_vocab is None else valid_vocab
    cross_entropy = _VocabParallelCrossEntropy.apply if group.size == 1 else _cross_entropy
    return cross_entropy(logits_shard, target, vocab_start, valid_vocab, group)
