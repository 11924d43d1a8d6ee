"""The learning rate and weight decay of every step, and the record of them a checkpoint keeps: Megatron's
``OptimizerParamScheduler``.

The state is Megatron's (its key names, lengths in samples): the peak, last and first rates, the warm-up
and decay lengths, the decay style, the weight decay at the start and end with its increment's style and
length, and ours beside them: WSD's decay length and style (Megatron keeps those in its args), the
decoupled rates of the embedding and output layer when --decoupled-lr is set. A resumed run compares its
own schedule with the checkpoint's before any process group exists (``schedule_mismatch``), as Megatron
does when it loads the scheduler: a difference is refused naming the flags, unless
``--use-checkpoint-opt_param-scheduler`` takes the checkpoint's schedule or
``--override-opt_param-scheduler`` takes the flags'. --finetune and --no-load-optim neither load nor check
it (Megatron's rule).
"""

from __future__ import annotations

import dataclasses

from pretrain.checkpoint.selection import resume_point
from pretrain.config.schema import Config, OptimizerConfig
from pretrain.training.batch_schedule import BatchSchedule
from pretrain.training.cooldown import branch_point, cooldown_schedule, run_end
from pretrain.training.lr_schedule import (LRSchedule, WeightDecaySchedule, build_lr_schedule,
                                          build_wd_schedule)

# state key -> the flags that set it
SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "init_lr": "--lr-warmup-init",
                  "lr_warmup_steps": "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction",
                  "lr_decay_steps": "--lr-decay-iters / --lr-decay-samples (default: the run's length, "
                                    "--train-iters / --train-samples)",
                  "lr_decay_style": "--lr-decay-style",
                  "wsd_decay_steps": "--lr-wsd-decay-iters / --lr-wsd-decay-samples",
                  "lr_wsd_decay_style": "--lr-wsd-decay-style",
                  "start_wd": "--weight-decay / --start-weight-decay", "end_wd": "--end-weight-decay",
                  "wd_incr_style": "--weight-decay-incr-style",
                  "wd_incr_steps": "--train-iters / --train-samples (a weight-decay increment's length)",
                  "decoupled_max_lr": "--decoupled-lr", "decoupled_min_lr": "--decoupled-min-lr",
                  "cooldown_from": "--cooldown-iters (the branch point)"}
# what only some schedules use: compared where one of the two states uses it
USED_BY = {"wsd_decay_steps": lambda state: state.get("lr_decay_style") == "WSD",
           "lr_wsd_decay_style": lambda state: state.get("lr_decay_style") == "WSD",
           "wd_incr_steps": lambda state: state.get("wd_incr_style", "constant") != "constant"}
FIX = ("add --use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, or "
       "--override-opt_param-scheduler to take these flags'")


class OptimizerParamScheduler:
    """Owns the rates of the run and its position in them: the main learning-rate schedule, the decoupled
    one of the embedding and output layer (--decoupled-lr), the weight decay, and ``num_steps``, the samples
    of the updates applied so far (Megatron's: a step that fp16's loss scaling skips does not advance it,
    though the data position moves on). ``step`` writes the rates into the optimizer's groups before each
    step (a group's weight decay times its ``wd_mult``: 0 for norms and biases), ``advance`` moves on after
    an applied update. Its state is a run state (plain JSON, the same on every rank). Loading one always
    takes its position, and its schedule only with ``use_checkpoint``
    (--use-checkpoint-opt_param-scheduler); it never checks: validation has compared both before anything
    was built."""

    def __init__(self, lr: LRSchedule, decoupled: LRSchedule | None, weight_decay: WeightDecaySchedule,
                 use_checkpoint: bool = False, cooldown_from: tuple[int, int] | None = None,
                 num_steps: int = 0):
        self.lr, self.decoupled, self.weight_decay = lr, decoupled, weight_decay
        self.use_checkpoint, self.cooldown_from = use_checkpoint, cooldown_from
        self.num_steps = num_steps

    def step(self, param_groups: list[dict]) -> float:
        """Set every group's rate and weight decay for the next step (at ``num_steps``); returns the main
        rate."""
        position = self.num_steps
        lr, weight_decay = self.lr(position), self.weight_decay(position)
        for group in param_groups:
            scale = group.get("lr_scale", 1.0)
            group["lr"] = (self.decoupled(position) if group.get("decoupled") else
                           self._scaled(scale)(position) if scale != 1.0 else lr)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        return lr

    def advance(self, samples: int) -> None:
        """An update of ``samples`` samples was applied (Megatron's ``step(increment)`` after a successful
        ``optimizer.step()``)."""
        self.num_steps += samples

    def _scaled(self, scale: float) -> LRSchedule:
        """The main schedule with its peak and final rates times ``scale`` (muP's groups; the warm-up's
        first rate is not scaled, as Megatron scales max_lr and min_lr alone)."""
        return dataclasses.replace(self.lr, lr=self.lr.lr * scale, min_lr=self.lr.min_lr * scale)

    def state_dict(self) -> dict:
        wd = self.weight_decay
        state = {"max_lr": self.lr.lr, "min_lr": self.lr.min_lr, "init_lr": self.lr.init_lr,
                 "lr_warmup_steps": self.lr.warmup_samples, "lr_decay_steps": self.lr.decay_samples,
                 "lr_decay_style": self.lr.style, "start_wd": wd.start, "end_wd": wd.end,
                 "wd_incr_style": wd.style, "wd_incr_steps": wd.incr_samples, "num_steps": self.num_steps}
        if self.lr.style == "WSD":
            state.update(wsd_decay_steps=self.lr.wsd_decay_samples, lr_wsd_decay_style=self.lr.wsd_style)
        if self.cooldown_from is not None:  # a cooldown branch's point: (iteration, consumed samples)
            state["cooldown_from"] = list(self.cooldown_from)
        if self.decoupled is not None:
            state.update(decoupled_max_lr=self.decoupled.lr, decoupled_min_lr=self.decoupled.min_lr)
        return state

    def load_state_dict(self, state: dict) -> None:
        if "num_steps" in state:  # (a checkpoint of before it was kept: the data position, set at build)
            self.num_steps = int(state["num_steps"])
        if not self.use_checkpoint:
            return
        self.lr = LRSchedule(state["max_lr"], state["min_lr"], state["init_lr"], state["lr_warmup_steps"],
                             state["lr_decay_steps"], state["lr_decay_style"], state.get("wsd_decay_steps"),
                             state.get("lr_wsd_decay_style", "exponential"))
        if self.decoupled is not None and "decoupled_max_lr" in state:
            self.decoupled = dataclasses.replace(self.lr, lr=state["decoupled_max_lr"],
                                                 min_lr=state["decoupled_min_lr"])
        self.cooldown_from = tuple(state["cooldown_from"]) if state.get("cooldown_from") else None
        self.weight_decay = WeightDecaySchedule(state["start_wd"], state["end_wd"],
                                                state.get("wd_incr_steps", 0.0),
                                                state.get("wd_incr_style", "constant"))


def build_param_scheduler(config: Config, batches: BatchSchedule) -> OptimizerParamScheduler:
    """The scheduler of the flags, for a run whose batches follow ``batches``."""
    opt, point = config.optimizer, branch_point(config)  # (a cooldown branch's: its manifest read once)
    decoupled = None
    if opt.decoupled_lr is not None:
        min_lr = opt.decoupled_min_lr if opt.decoupled_min_lr is not None else opt.min_lr
        decoupled = _schedule(dataclasses.replace(opt, lr=opt.decoupled_lr, min_lr=min_lr), config, batches,
                              point)
    train, resumed = config.training, resume_point(config)
    return OptimizerParamScheduler(_schedule(opt, config, batches, point), decoupled,
                                   build_wd_schedule(opt, train.train_iters, train.train_samples, batches),
                                   config.checkpoint.use_checkpoint_opt_param_scheduler, point,
                                   resumed[1] if resumed else 0)


def _schedule(opt: OptimizerConfig, config: Config, batches: BatchSchedule,
              point: tuple[int, int] | None) -> LRSchedule:
    """The flags' learning rate (a cooldown branch's: decaying from its branch ``point`` to its end)."""
    schedule = build_lr_schedule(opt, config.training.train_iters, config.training.train_samples, batches)
    if point is None:
        return schedule
    return cooldown_schedule(schedule, point, batches.lr_samples(run_end(config, point)))


def schedule_mismatch(saved: dict, ours: dict, ignored: tuple[str, ...] = ()) -> str | None:
    """What differs between a checkpoint's scheduler state and this run's, as "FLAGS: VALUE (the
    checkpoint's: VALUE)" parts, or None when they agree (``ignored``: keys not compared)."""
    differences = []
    for key, flags in SCHEDULE_FLAGS.items():
        if key not in saved and key not in ours or key in ignored or (
                key in USED_BY and not (USED_BY[key](saved) or USED_BY[key](ours))):
            continue
        theirs, mine = saved.get(key), ours.get(key)
        if isinstance(theirs, float) or isinstance(mine, float):
            same = (theirs is not None and mine is not None
                    and abs(theirs - mine) <= 1e-12 * max(abs(theirs), 1))
        else:
            same = theirs == mine
        if not same:
            unit = " samples" if key.endswith("_steps") else ""
            differences.append(f"{flags}: {_shown(mine)}{unit} (the checkpoint's: {_shown(theirs)}{unit})")
    return "; ".join(differences) or None


def _shown(value) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
