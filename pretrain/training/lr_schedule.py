"""The learning rate of each step, counted in samples as Megatron-LM's scheduler counts it.

Warm-up rises linearly from ``--lr-warmup-init`` to ``--lr``; then cosine or linear decay to
``--min-lr`` (or constant), ending at the decay length and staying at ``--min-lr`` after. Lengths are
samples: ``--lr-warmup-samples`` / ``--lr-decay-samples`` directly, iteration-based flags
(``--lr-warmup-iters``, ``--lr-decay-iters``, default ``--train-iters``) times the final global batch
size (in a run resumed with another batch: the samples consumed by that iteration), and
``--lr-warmup-fraction`` of the decay length. The step that starts after S consumed samples
uses the rate at S, so with a constant batch the sample and iteration spellings give the same rates,
and under a batch ramp-up the schedule follows the samples actually seen. Pure: resuming is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.schema import OptimizerConfig
from pretrain.training.batch_schedule import BatchSchedule


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up and decay lengths in samples, and the rates; a value that never changes during a run."""

    lr: float
    min_lr: float
    init_lr: float
    warmup_samples: float
    decay_samples: float
    style: str

    def __call__(self, consumed_samples: int) -> float:
        if self.warmup_samples > 0 and consumed_samples <= self.warmup_samples:
            return self.init_lr + (self.lr - self.init_lr) * consumed_samples / self.warmup_samples
        if self.style == "constant":
            return self.lr
        if consumed_samples > self.decay_samples:
            return self.min_lr
        progress = (consumed_samples - self.warmup_samples) / max(self.decay_samples - self.warmup_samples, 1)
        factor = 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor


def build_lr_schedule(config: OptimizerConfig, train_iters: int, train_samples: int | None,
                      batches: BatchSchedule) -> LRSchedule:
    """The schedule of a run of ``train_iters`` iterations (or ``train_samples`` samples) whose batches
    follow ``batches`` (iteration-based lengths in samples by ``BatchSchedule.lr_samples``)."""
    if config.lr_decay_samples is not None:
        decay = config.lr_decay_samples
    elif config.lr_decay_iters is not None:
        decay = batches.lr_samples(config.lr_decay_iters)
    else:
        decay = train_samples if train_samples is not None else batches.lr_samples(train_iters)
    if config.lr_warmup_fraction is not None:
        warmup = config.lr_warmup_fraction * decay
    elif config.lr_warmup_samples:
        warmup = config.lr_warmup_samples
    else:
        warmup = batches.lr_samples(config.lr_warmup_iters)
    return LRSchedule(config.lr, config.min_lr, config.lr_warmup_init, warmup, decay, config.lr_decay_style)
