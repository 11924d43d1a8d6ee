"""The learning rate and weight decay of each step, counted in samples as Megatron-LM's scheduler counts
them (megatron-core's ``OptimizerParamScheduler``: its formulas, step for step).

Warm-up rises linearly from ``--lr-warmup-init`` to ``--lr``; then cosine or linear decay to
``--min-lr`` (or constant; inverse-square-root: ``lr x sqrt(warm-up / samples)``, never below
``--min-lr``; WSD: ``--lr`` until the last ``--lr-wsd-decay-iters`` (``-samples``) before the decay's end,
then ``--lr-wsd-decay-style`` down to ``--min-lr``), ending at the decay length and staying at
``--min-lr`` after. Weight decay goes from ``--start-weight-decay`` to ``--end-weight-decay`` over the
run (linear or cosine), or stays ``--weight-decay``. Lengths are
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
    wsd_decay_samples: float | None = None  # WSD: the decay's length, ending at ``decay_samples``
    wsd_style: str = "exponential"

    def __call__(self, consumed_samples: int) -> float:
        if self.warmup_samples > 0 and consumed_samples <= self.warmup_samples:
            return self.init_lr + (self.lr - self.init_lr) * consumed_samples / self.warmup_samples
        if self.style == "constant":
            return self.lr
        if consumed_samples > self.decay_samples:
            return self.min_lr
        if self.style == "inverse-square-root":
            rate = self.lr * max(self.warmup_samples, 1) ** 0.5 / max(consumed_samples, 1) ** 0.5
            return max(self.min_lr, rate)
        if self.style == "WSD":
            return self.min_lr + (self.lr - self.min_lr) * self._wsd(consumed_samples)
        progress = (consumed_samples - self.warmup_samples) / max(self.decay_samples - self.warmup_samples, 1)
        factor = 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor

    def _wsd(self, consumed_samples: int) -> float:
        """WSD's factor: 1 in the stable phase, then its decay style of the fraction of decay done."""
        start = self.decay_samples - self.wsd_decay_samples
        if consumed_samples <= start:
            return 1.0
        done = (consumed_samples - start) / self.wsd_decay_samples
        return {"linear": lambda: 1.0 - done, "cosine": lambda: 0.5 * (math.cos(math.pi * done) + 1.0),
                "exponential": lambda: 2.0 * 0.5 ** done - 1.0,
                "minus_sqrt": lambda: 1.0 - math.sqrt(done)}[self.wsd_style]()


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Weight decay from ``start`` to ``end`` over ``incr_samples`` (style linear or cosine), ``end``
    after it; constant: ``end`` throughout."""

    start: float
    end: float
    incr_samples: float
    style: str = "constant"

    def __call__(self, consumed_samples: int) -> float:
        if self.style == "constant" or consumed_samples > self.incr_samples:
            return self.end
        ratio = consumed_samples / max(self.incr_samples, 1)
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start + coeff * (self.end - self.start)


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
    wsd = None
    if config.lr_decay_style == "WSD":
        wsd = (config.lr_wsd_decay_samples if config.lr_wsd_decay_samples is not None
               else batches.lr_samples(config.lr_wsd_decay_iters))
    return LRSchedule(config.lr, config.min_lr, config.lr_warmup_init, warmup, decay, config.lr_decay_style,
                      wsd, config.lr_wsd_decay_style)


def build_wd_schedule(config: OptimizerConfig, train_iters: int, train_samples: int | None,
                      batches: BatchSchedule) -> WeightDecaySchedule:
    """The weight decay of a run of ``train_iters`` iterations (or ``train_samples`` samples): Megatron's
    increment runs over the whole run."""
    if config.weight_decay_incr_style == "constant":
        return WeightDecaySchedule(config.weight_decay, config.weight_decay, 0.0)
    length = train_samples if train_samples is not None else batches.lr_samples(train_iters)
    return WeightDecaySchedule(config.start_weight_decay, config.end_weight_decay, length,
                               config.weight_decay_incr_style)
