"""How many samples each iteration takes, and how long the run is, in Megatron-LM's terms.

The global batch is constant (``--global-batch-size``) or grows with the samples consumed so far:

- ``--rampup-batch-size START INCREMENT SAMPLES``: START samples per step at first, INCREMENT more
  after each equal share of SAMPLES consumed samples, up to ``--global-batch-size`` (Megatron's
  ramp-up);
- ``--step-batch-size-schedule "T0:B0 T1:B1 ..."``: B_i samples per step once T_i tokens are consumed
  (T0 = 0; K/M/B/T suffixes; replaces ``--global-batch-size``), as Megatron reads it.

The run ends after ``--train-iters`` iterations, or after the iterations that ``--train-samples``
fill (a last partial batch dropped, as Megatron does). Everything is a pure function of the consumed
samples, so a resumed run continues at the exact sample and batch size.

A run resumed with another batch than its checkpoint's (``--global-batch-size`` given anew) is
``resumed`` at the checkpoint's (iteration, consumed samples): its iterations before that point count the
checkpoint's samples, those after it the new batches from there, so that it still ends at
``--train-iters`` (or ``--train-samples``) and its iteration-based learning-rate lengths end there too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch size as a function of consumed samples. Owns only the schedule's numbers; it
    never reads data. ``per_step`` is micro-batch x data-parallel size, which every batch divides."""

    global_batch_size: int
    per_step: int
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None  # (from consumed samples, batch size), sorted
    resumed: tuple[int, int] | None = None  # (iteration, consumed samples) where the batch changed

    def batch_size(self, consumed_samples: int) -> int:
        if self.steps is not None:
            return [size for start, size in self.steps if start <= consumed_samples][-1]
        if self.rampup is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup
        if consumed_samples > ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - start) // increment
        if increments == 0:
            return self.global_batch_size
        return min(start + int(consumed_samples / (ramp_samples / increments)) * increment,
                   self.global_batch_size)

    def micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank in the step that starts at ``consumed_samples``."""
        return self.batch_size(consumed_samples) // self.per_step

    def sizes(self) -> list[int]:
        """Every batch size the schedule can take."""
        if self.steps is not None:
            return sorted({size for _, size in self.steps})
        if self.rampup is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup
        return list(range(start, self.global_batch_size, increment)) + [self.global_batch_size]

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        start_iteration, consumed = self.resumed or (0, 0)
        if iterations < start_iteration:  # the checkpoint's own iterations, at its mean batch
            return consumed * iterations // start_iteration
        for _ in range(iterations - start_iteration):
            consumed += self.batch_size(consumed)
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Iterations that ``train_samples`` fill; a last partial batch is dropped."""
        iterations, consumed = self.resumed or (0, 0)
        if train_samples < consumed:
            return iterations * train_samples // consumed
        while consumed + self.batch_size(consumed) <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        return iterations

    def lr_samples(self, iterations: int) -> int:
        """The samples that an iteration-based learning-rate length of ``iterations`` counts: Megatron's
        iterations x the final batch, or the samples really consumed by then in a resumed schedule."""
        return self.samples_after(iterations) if self.resumed else iterations * self.final_batch_size

    def resumed_at(self, iteration: int, consumed_samples: int) -> BatchSchedule:
        """This schedule for a run resumed at (``iteration``, ``consumed_samples``): itself when it would
        have consumed exactly those samples (the batch did not change), else anchored there."""
        if self.resumed is None and self.samples_after(iteration) == consumed_samples:
            return self
        return replace(self, resumed=(iteration, consumed_samples))

    @property
    def final_batch_size(self) -> int:
        """The batch the schedule ends at: iteration-based LR flags count in samples of this size."""
        return self.sizes()[-1] if self.steps is not None else self.global_batch_size


_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _count(text: str) -> int:
    """'2.4B' -> 2400000000 (K, M, B, T suffixes, any case), '16' -> 16."""
    factor = _SUFFIXES.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if factor != 1 else text) * factor)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """Megatron's 'THRESHOLD:BATCH ...' (entries split by spaces or commas; K/M/B/T suffixes; thresholds
    count tokens, turned into samples of ``seq_length``) -> ((from sample, batch), ...)."""
    try:
        pairs = [item.split(":") for item in text.replace(",", " ").split()]
        steps = tuple((_count(threshold) // seq_length, _count(size)) for threshold, size in pairs)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule {text!r}: expected 'TOKENS:BATCH ...', e.g. '0:16 "
                         "2.4B:320'") \
            from None
    starts = [start for start, _ in steps]
    if not steps or starts[0] != 0 or starts != sorted(set(starts)) or any(size < 1 for _, size in steps):
        raise ValueError(f"--step-batch-size-schedule {text!r}: thresholds start at 0 and increase, batches "
                         "are >= 1")
    return steps


def build_batch_schedule(global_batch_size: int | None, micro_batch_size: int, dp: int,
                         rampup: list[int] | None, step_schedule: str | None,
                         seq_length: int) -> BatchSchedule:
    """The schedule the flags describe; ValueError naming the flag for any batch that micro-batch x dp does
    not divide, or flags that contradict each other."""
    per_step = micro_batch_size * dp
    if step_schedule is not None:
        if global_batch_size is not None:
            raise ValueError("--step-batch-size-schedule sets the global batch at every step: drop "
                             "--global-batch-size")
        if rampup is not None:
            raise ValueError("--step-batch-size-schedule and --rampup-batch-size are two batch schedules: "
                             "choose one")
        steps = parse_step_schedule(step_schedule, seq_length)
        schedule = BatchSchedule(steps[-1][1], per_step, steps=steps)
        what = "--step-batch-size-schedule"
    else:
        global_batch_size = global_batch_size or per_step
        if rampup is not None:
            if len(rampup) != 3 or min(rampup) < 1:
                raise ValueError(f"--rampup-batch-size {rampup}: expected START INCREMENT SAMPLES, all >= 1")
            start, increment, _ = rampup
            if start > global_batch_size or (global_batch_size - start) % increment:
                raise ValueError(f"--rampup-batch-size {' '.join(map(str, rampup))}: from {start} in "
                                 "steps of "
                                 f"{increment} it must reach --global-batch-size {global_batch_size}")
            what = "--rampup-batch-size"
        else:
            what = "--global-batch-size"
        schedule = BatchSchedule(global_batch_size, per_step, tuple(rampup) if rampup else None)
    for size in schedule.sizes():
        if size % per_step:
            batch = (f"--global-batch-size {size}" if what == "--global-batch-size"
                     else f"{what}: a global batch of {size}")
            raise ValueError(f"{batch} is not divisible by --micro-batch-size {micro_batch_size} x "
                             "data-parallel size "
                             f"{dp} = {per_step}: use multiples of {per_step}")
    return schedule
