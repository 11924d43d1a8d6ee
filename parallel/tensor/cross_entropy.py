"""Cross entropy over logits split by vocabulary range across the tensor-parallel group.

No rank ever materialises the full [s, b, vocab] logits: each step below works on this rank's
[s, b, vocab/tp] shard, and only [s, b] tensors cross the group.
"""

from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import AxisGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_vocab, group):
        if logits.dtype in (torch.float16, torch.bfloat16):  # reduce in fp32
            logits = logits.float()
        width = logits.shape[-1]
        # 1. padded vocabulary entries (ids >= valid_vocab) take no probability
        ids = torch.arange(vocab_start, vocab_start + width, device=logits.device)
        logits = logits.masked_fill(ids >= valid_vocab, float("-inf"))
        # 2. global max over the vocabulary, for a stable exp
        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        # 3. the target's logit, from the one rank whose range holds it
        outside = (target < vocab_start) | (target >= vocab_start + width)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)
        # 4. sum of exp over the whole vocabulary
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        # 5. loss = log(sum exp) - target logit
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # turns the saved softmax into the gradient in place (no second [s, b, v/tp] buffer), so this
        # graph supports one backward only (no retain_graph), as in Megatron
        softmax, local_target, outside = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), the one-hot only on the owning rank
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: AxisGroup,
                                 valid_vocab: int | None = None) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logits shard [s, b, vocab/tp] and global target ids.

    ``valid_vocab`` (the tokenizer's vocabulary) excludes padded entries from the softmax.
    """
    width = logits_shard.shape[-1]
    vocab_start = group.rank * width
    valid_vocab = width * group.size if valid_vocab is None else valid_vocab
    return _VocabParallelCrossEntropy.apply(logits_shard, target, vocab_start, valid_vocab, group)
