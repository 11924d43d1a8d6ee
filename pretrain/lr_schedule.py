"""Learning rate per iteration: linear warm-up from 0, then cosine/linear decay to min-lr (or constant)."""

from __future__ import annotations

import math

from pretrain.config import OptimizerConfig


def learning_rate(iteration: int, config: OptimizerConfig, train_iters: int) -> float:
    """The learning rate for optimizer step ``iteration`` (0-based). Pure: no state, so resuming is exact."""
    if config.lr_warmup_iters and iteration < config.lr_warmup_iters:
        return config.lr * (iteration + 1) / config.lr_warmup_iters
    if config.lr_decay_style == "constant":
        return config.lr
    decay_end = config.lr_decay_iters or train_iters
    span = max(decay_end - config.lr_warmup_iters, 1)
    progress = min(max(iteration - config.lr_warmup_iters, 0) / span, 1.0)
    if config.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + (config.lr - config.min_lr) * factor
