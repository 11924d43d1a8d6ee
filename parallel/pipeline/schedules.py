"""Pipeline schedules: the order in which one pipeline rank runs its actions in an optimizer step.

An action is the forward (F) of a (chunk, micro-batch), its backward (B), or, in the zero-bubble
schedules, its weight-gradient pass (W): there B computes only the gradient of the chunk's input (what
the previous stage waits for) and W the gradients of the weights, later, where the stage would
otherwise wait. Every rank derives its order from the same rule:

    gpipe        all F in micro-batch order, then all B in micro-batch order (holds all m activations)
    1f1b         pp - stage - 1 warm-up F, then alternate F/B, then cool-down B (holds at most pp)
    interleaved  1F1B over vp model chunks per stage: micro-batches go through the stages in groups
                 of pp, chunk by chunk (Megatron's order); the bubble shrinks by vp
    zb-h1        1F1B with B split from W (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-H1): stage s
                 holds back s weight passes in the steady state and runs them in the cool-down's gaps;
                 no stage holds more micro-batches than 1F1B's first stage (pp), the bubble is
                 (pp - 1)(F + B - W) instead of (pp - 1)(F + B + W)
    zbv          two chunks per stage placed in a V (``parallel.pipeline.partition``), B split from W: the
                 forwards of chunk 0 fill the start, chunk 1's B and W follow at once, and the steady state
                 runs F B W of each chunk in turn (Qi et al., ZB-V); with F = B = W and m >= 2 pp - 1 no
                 stage idles after its first forward arrives, holding 1F1B's first-stage activations

Where the neighbours' tensors are exchanged is not part of a schedule: ``parallel.pipeline.timeline``
derives it from every rank's order at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_SCHEDULES = ("zb-h1", "zbv")  # those whose backward is split into B and W
V_SCHEDULES = ("zbv",)  # those whose two chunks per stage are placed in a V


@dataclass(frozen=True)
class Action:
    """Forward ("F"), backward ("B") or weight-gradient pass ("W") of ``micro_batch`` through model chunk
    ``chunk``."""

    kind: str
    chunk: int
    micro_batch: int


def _interleaved_slots(m: int, pp: int, vp: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of this rank's forwards in the interleaved order: groups of pp micro-batches
    (the last one shorter when pp does not divide m: a forward-only step, generation's one sequence), each
    group through every chunk in turn."""
    slots = []
    for start in range(0, m, pp):
        slots += [(chunk, i) for chunk in range(vp) for i in range(start, min(start + pp, m))]
    return slots


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup:]


def _zero_bubble_h1(m: int, pp: int, stage: int) -> list[Action]:
    """1F1B's order of F and B, each B followed by the W of the micro-batch ``stage`` backwards earlier;
    the held-back W close the step."""
    order, pending = [], deque()
    for action in _one_f_one_b([Action("F", 0, i) for i in range(m)], [Action("B", 0, i) for i in range(m)],
                               min(pp - stage - 1, m)):
        order.append(action)
        if action.kind == "B":
            pending.append(action.micro_batch)
            if len(pending) > stage:
                order.append(Action("W", 0, pending.popleft()))
    return order + [Action("W", 0, i) for i in pending]


def _zero_bubble_v(m: int, pp: int, stage: int) -> list[Action]:
    """ZB-V's order for stage ``stage``, laid out for max(m, 2 pp - 1) micro-batches (the fewest that fill
    the V) and cut to those that exist."""
    n = max(m, 2 * pp - 1)
    order: list[Action] = []
    made = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0, ("W", 0): 0, ("W", 1): 0}

    def run(kind: str, chunk: int) -> None:
        order.append(Action(kind, chunk, made[(kind, chunk)]))
        made[(kind, chunk)] += 1

    for _ in range(2 * (pp - stage) - 1):  # chunk 0's forwards until the first micro-batch turns in the V
        run("F", 0)
    for _ in range(stage):
        run("F", 1)
        run("F", 0)
    for _ in range(pp - stage):  # chunk 1 starts its backwards, each with its weight pass
        for kind in "FBW":
            run(kind, 1)
    while made[("F", 1)] < made[("F", 0)] or made[("F", 0)] < n:  # the steady state
        if made[("F", 0)] < n:
            run("F", 0)
        for chunk in (0, 1):
            for kind in ("BW" if chunk == 0 else "FBW"):
                run(kind, chunk)
    for _ in range(stage):  # the cool-down: input gradients first, the weight passes in the gaps
        run("B", 0)
        run("B", 1)
    for _ in range(pp - stage):
        run("B", 0)
        run("W", 0)
    while made[("W", 1)] < made[("B", 1)]:
        run("W", 1)
    while made[("W", 0)] < made[("B", 0)]:
        run("W", 0)
    return [a for a in order if a.micro_batch < m]


def schedule_actions(kind: str, num_micro_batches: int, pp: int, stage: int, vp: int = 1) -> list[Action]:
    """The ordered actions of pipeline stage ``stage`` for one optimizer step (see the module docstring)."""
    m = num_micro_batches
    if kind == "gpipe":
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]
    if kind == "1f1b":
        return _one_f_one_b([Action("F", 0, i) for i in range(m)], [Action("B", 0, i) for i in range(m)],
                            min(pp - stage - 1, m))
    if kind == "interleaved":
        slots = _interleaved_slots(m, pp, vp)
        forwards = [Action("F", c, i) for c, i in slots]
        backwards = [Action("B", vp - 1 - c, i) for c, i in slots]
        return _one_f_one_b(forwards, backwards, min((pp - stage - 1) * 2 + (vp - 1) * pp, len(slots)))
    if kind == "zb-h1":
        return _zero_bubble_h1(m, pp, stage)
    if kind == "zbv":
        return _zero_bubble_v(m, pp, stage)
    raise ValueError(f"unknown --pipeline-schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")


def validate_schedule_flags(kind: str, vp: int) -> None:
    """Raise ValueError naming the flags for a schedule that cannot run with ``vp`` chunks per stage, at
    any batch."""
    if kind in V_SCHEDULES and vp != 2:
        raise ValueError(f"--pipeline-schedule {kind} runs two model chunks per stage in a V: "
                         f"--virtual-pipeline-size must be 2 (or left out), got {vp}")
    if vp > 1 and kind not in ("interleaved", *V_SCHEDULES):
        raise ValueError(f"--virtual-pipeline-size {vp} runs {vp} model chunks per stage: it needs "
                         f"--pipeline-schedule interleaved (or zbv for 2), not {kind}")


def validate_schedule(kind: str, num_micro_batches: int, pp: int, vp: int) -> None:
    """Raise ValueError naming the flags for a schedule that cannot run ``num_micro_batches``."""
    validate_schedule_flags(kind, vp)
    if kind == "interleaved" and pp > 1 and num_micro_batches % pp:
        raise ValueError(f"--pipeline-schedule interleaved needs the micro-batches per step "
                         f"({num_micro_batches} = --global-batch-size / (--micro-batch-size x dp)) to be a "
                         f"multiple of --pipeline-model-parallel-size {pp}")
    if kind == "interleaved" and num_micro_batches < pp:
        raise ValueError(f"--pipeline-schedule interleaved needs at least {pp} micro-batches per step, got "
                         f"{num_micro_batches}: raise --global-batch-size")
