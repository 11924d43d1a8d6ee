"""When a run logs, evaluates, saves and stops, decided alike on every rank.

A run stops early, saving first when ``--save`` is set, on a preemption signal (SIGTERM, SIGUSR1) or
Ctrl-C (SIGINT; all three caught only when saving: the launcher passes its own on to the workers), at
an ``--exit-interval`` iteration, or once ``--exit-duration-in-mins`` have
passed since the trainer started (Megatron counts from process start); and without saving when a
background save (``--async-save``) failed on some rank. The signal, the clock and a writer's failure
differ between ranks, so they are agreed with one all-reduce per iteration, made only when one of
them can matter.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch

from parallel import comm
from parallel.comm import AxisGroup
from pretrain.config.schema import Config
from pretrain.training.cooldown import run_end


@dataclass(frozen=True)
class Decision:
    """What to do after one iteration."""

    record: bool  # a metrics line (file, wandb, TensorBoard)
    console: bool  # ... also printed
    evaluate: bool
    save: bool
    stop: str | None  # why the run ends early (None: it goes on)


class RunControl:
    """Owns the signal flag and the start time. Never saves, logs or evaluates by itself: ``after``
    says what the trainer must do."""

    def __init__(self, config: Config, world: AxisGroup, device: torch.device = torch.device("cpu")):
        self.config, self.world, self.device = config, world, device  # NCCL reduces device tensors only
        self.end = run_end(config)  # --train-iters, or a cooldown branch's end
        self.started = time.monotonic()
        self._signal_received = False
        if config.checkpoint.save:  # cluster preemption: save, then stop (without --save: default exit)
            for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._signal_received = True

    @property
    def signal_received(self) -> bool:
        """Whether SIGTERM, SIGUSR1 or SIGINT came (a preemption, Ctrl-C, or the launcher tearing the job
        down)."""
        return self._signal_received

    def _agreed_flags(self, save_failed: bool) -> tuple[bool, bool, bool]:
        """(a signal arrived on some rank, the duration is up on some rank, a background save failed on
        some rank); a collective over the world."""
        minutes = self.config.training.exit_duration_in_mins
        late = minutes is not None and time.monotonic() - self.started >= 60 * minutes
        flags = torch.tensor([float(self._signal_received), float(late), float(save_failed)],
                             device=self.device)
        comm.all_reduce(flags, self.world, op=torch.distributed.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def _evaluates(self, iteration: int) -> bool:
        train = self.config.training
        return bool(train.eval_interval) and (iteration % train.eval_interval == 0
                                              or iteration == self.end)

    def records(self, iteration: int, first: bool = False) -> bool:
        """Whether ``iteration`` writes a metrics line at its interval (known before it runs; the line an
        early stop adds, by a signal, --exit-duration-in-mins or --exit-interval, is not). The trainer
        measures what only these lines report."""
        logging, last = self.config.logging, iteration == self.end
        return (iteration % logging.log_interval == 0 or self._evaluates(iteration) or first or last
                or (logging.tensorboard_dir is not None
                    and iteration % logging.tensorboard_log_interval == 0))

    def after(self, iteration: int, first: bool = False, save_failed: bool = False) -> Decision:
        """The decision after ``iteration`` (every rank calls it, in step); ``first``: the run's first
        iteration (a resumed run's too); ``save_failed``: this rank's background save failed."""
        config, train = self.config, self.config.training
        last = iteration == self.end
        signalled, late, failed = (self._agreed_flags(save_failed)
                                   if config.checkpoint.save or train.exit_duration_in_mins
                                   else (False, False, False))
        if failed:  # nothing more is saved; the trainer reports the failure
            return Decision(True, True, False, False, "a failed checkpoint save")
        stop = ("a preemption signal" if signalled else
                f"--exit-duration-in-mins {train.exit_duration_in_mins}" if late else
                f"--exit-interval {train.exit_interval}"
                if train.exit_interval and iteration % train.exit_interval == 0 and not last else None)
        evaluate = self._evaluates(iteration)
        logging = config.logging
        console = iteration % logging.log_interval == 0 or evaluate or first or last or stop is not None
        record = self.records(iteration, first) or stop is not None
        interval = config.checkpoint.save_interval
        save = bool(config.checkpoint.save) and (last or stop is not None
                                                 or bool(interval and iteration % interval == 0))
        return Decision(record, console, evaluate, save, stop)
