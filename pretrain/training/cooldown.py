"""Cooldown branches (``--cooldown-iters K``): a warmup-stable-decay run's stable-phase checkpoint continued
by a run that decays over the next K iterations, one point of a scaling study's loss-against-tokens curve
per branch (MiniCPM, DeepSeek LLM; Hagele et al. 2024), at a fraction of a separate run's compute.

The branch resumes the checkpoint whole (``--load``, ``--ckpt-step``): its data position goes on where the
stable run stopped, over the stable run's own data order (its ``--train-iters``, which the order depends
on, is kept), so it never reads again what the stable run trained on. Its schedule is the stable run's
with the decay moved: WSD ending K iterations after the branch point, decaying over all of them
(``--lr-wsd-decay-style`` to ``--min-lr``), which is a separate run's schedule with ``--lr-decay-iters``
at the branch's end. The branch point is kept in the scheduler's state (``cooldown_from``), so a branch
stopped mid-decay resumes from its own checkpoint to the same end.
"""

from __future__ import annotations

import dataclasses

from pretrain.checkpoint.selection import resume_point, resumed_manifest, resumed_state
from pretrain.config.schema import Config
from pretrain.training.lr_schedule import LRSchedule

BRANCH_KEYS = ("lr_decay_steps", "wsd_decay_steps", "lr_decay_style", "lr_wsd_decay_style", "cooldown_from")


def branch_point(config: Config) -> tuple[int, int] | None:
    """(iteration, consumed samples) a cooldown branch decays from: its checkpoint's own branch point
    where it is a branch itself, else the checkpoint it resumes; None for a run that is no branch."""
    if not config.training.cooldown_iters:
        return None
    saved = resumed_state(config, "opt_param_scheduler") or {}
    if saved.get("cooldown_from") is not None:
        return tuple(saved["cooldown_from"])
    return resume_point(config)


def run_end(config: Config, point: tuple[int, int] | None = None) -> int:
    """The iteration the run ends at: a branch's cooldown end (from its ``point``, else its
    ``branch_point``), else --train-iters."""
    point = point or branch_point(config)
    return config.training.train_iters if point is None else point[0] + config.training.cooldown_iters


def cooldown_schedule(schedule: LRSchedule, point: tuple[int, int], end_samples: int) -> LRSchedule:
    """``schedule`` decaying (WSD) from the branch ``point`` to ``end_samples`` consumed."""
    return dataclasses.replace(schedule, style="WSD", decay_samples=end_samples,
                               wsd_decay_samples=end_samples - point[1])


def branch_refusal(config: Config) -> str | None:
    """Why ``--cooldown-iters`` cannot branch from the checkpoint to load (None: it can)."""
    train, point, manifest = config.training, resume_point(config), resumed_manifest(config) or {}
    saved_schedule = manifest.get("states", {}).get("opt_param_scheduler")
    flag = f"--cooldown-iters {train.cooldown_iters}"
    if config.checkpoint.no_load_optim or point is None or saved_schedule is None:
        return (f"{flag} branches from a checkpoint of a stable run: give --load (and --ckpt-step) with "
                "its optimizer states")
    start = branch_point(config)
    if saved_schedule.get("cooldown_from") is None:  # a fresh branch: the checkpoint must be stable
        style, decay = saved_schedule.get("lr_decay_style"), saved_schedule.get("lr_decay_steps", 0)
        stable_until = decay - (saved_schedule.get("wsd_decay_steps") or 0) if style == "WSD" else None
        if style != "constant" and (stable_until is None or start[1] > stable_until
                                    or start[1] < saved_schedule.get("lr_warmup_steps", 0)):
            return (f"{flag}: the checkpoint of iteration {start[0]} is not in a stable phase (its schedule: "
                    f"{style}, warm-up to {saved_schedule.get('lr_warmup_steps', 0):g} samples, stable to "
                    f"{stable_until if stable_until is not None else 'never'}; this point: {start[1]} "
                    "samples): branch from a warmup-stable-decay run's stable checkpoint")
    saved_iters = manifest.get("config", {}).get("train_iters")
    if saved_iters is not None and train.train_iters != saved_iters:
        return (f"{flag}: --train-iters {train.train_iters} differs from the stable run's {saved_iters}, "
                "whose data order the branch continues (the order depends on the run's length): give "
                f"--train-iters {saved_iters} or leave it out")
    if start[0] + train.cooldown_iters > train.train_iters:
        return (f"{flag} from iteration {start[0]} ends past the stable run's data (--train-iters "
                f"{train.train_iters}): branch earlier or cool down for fewer iterations")
    return None
