"""Pipeline schedules as per-rank action lists, and the executor that runs them.

A schedule is the order in which this rank runs forward (F) and backward (B) of (chunk, micro-batch)
pairs. Every rank derives its list from the same rule, so for each pair of neighbours the order of
sends on one side equals the order of receives on the other:

    gpipe        all F in micro-batch order, then all B in micro-batch order (holds all m activations)
    1f1b         pp - stage - 1 warm-up F, then alternate F/B, then cool-down B (holds at most pp)
    interleaved  1F1B over vp model chunks per stage: micro-batches go through the stages in groups
                 of pp, chunk by chunk (Megatron's order); the bubble shrinks by vp

The executor runs the list as steps, with one exchange between two steps: the sends the previous
step produced together with the receives the next step needs (``StageExchange.exchange``). A step is
one action, except in the interleaved steady state, where a forward and the backward after it form
one step, as in Megatron (there the backward's gradient comes from a stage that is itself sending,
and only receiving it in the same batch as the forward's input keeps rendezvous sends from waiting on
each other).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel.pipeline.p2p import StageExchange


@dataclass(frozen=True)
class Action:
    """Forward ("F") or backward ("B") of ``micro_batch`` through model chunk ``chunk``."""

    kind: str
    chunk: int
    micro_batch: int


def _forward_slot(k: int, pp: int, vp: int) -> tuple[int, int]:
    """(chunk, micro-batch) of this rank's k-th forward in the interleaved order."""
    group, within = divmod(k, pp * vp)
    return within // pp, group * pp + within % pp


def schedule_steps(kind: str, num_micro_batches: int, pp: int, stage: int,
                   vp: int = 1) -> list[tuple[Action, ...]]:
    """The ordered steps of pipeline stage ``stage`` for one optimizer step (see the module docstring)."""
    m = num_micro_batches
    if kind == "gpipe":
        return [(Action("F", 0, i),) for i in range(m)] + [(Action("B", 0, i),) for i in range(m)]
    if kind == "1f1b":
        forwards = [Action("F", 0, i) for i in range(m)]
        backwards = [Action("B", 0, i) for i in range(m)]
        warmup = min(pp - stage - 1, m)
    elif kind == "interleaved":
        total = m * vp
        forwards = [Action("F", *_forward_slot(k, pp, vp)) for k in range(total)]
        backwards = [Action("B", vp - 1 - c, i) for c, i in (_forward_slot(k, pp, vp) for k in range(total))]
        warmup = min((pp - stage - 1) * 2 + (vp - 1) * pp, total)
    else:
        raise ValueError(f"unknown --pipeline-schedule {kind!r}: choose gpipe, 1f1b or interleaved")
    order: list[tuple[Action, ...]] = [(f,) for f in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards):
        order += [(f, b)] if kind == "interleaved" else [(f,), (b,)]
    return order + [(b,) for b in backwards[len(forwards) - warmup:]]


def validate_schedule(kind: str, num_micro_batches: int, pp: int, vp: int) -> None:
    """Raise ValueError naming the flags for a schedule that cannot run."""
    if vp > 1 and kind != "interleaved":
        raise ValueError(f"--virtual-pipeline-size {vp} needs --pipeline-schedule interleaved")
    if kind == "interleaved" and pp > 1 and num_micro_batches % pp:
        raise ValueError(f"--pipeline-schedule interleaved needs the micro-batches per step "
                         f"({num_micro_batches} = --global-batch-size / (--micro-batch-size x dp)) to be a "
                         f"multiple of --pipeline-model-parallel-size {pp}")
    if kind == "interleaved" and num_micro_batches < pp:
        raise ValueError(f"--pipeline-schedule interleaved needs at least {pp} micro-batches per step, got "
                         f"{num_micro_batches}: raise --global-batch-size")


@dataclass
class StepStats:
    """What the executor measured in one step: the losses (last stage; device tensors, read once the
    step ends, so the host never waits for a micro-batch) and activation residency."""

    losses: list[torch.Tensor] = field(default_factory=list)
    max_live_micro_batches: dict[int, int] = field(default_factory=dict)


ForwardStep = Callable[[int, int, torch.Tensor | None], torch.Tensor]
BackwardStep = Callable[[int, int, torch.Tensor, torch.Tensor | None, bool], None]


def plain_backward(chunk: int, micro_batch: int, output: torch.Tensor, grad: torch.Tensor | None,
                   last: bool) -> None:
    torch.autograd.backward(output, grad)


class PipelineExecutor:
    """Runs a list of actions on this stage's model chunks.

    Owns the activations kept between a micro-batch's forward and its backward (input and output of
    each chunk) and releases them right after the backward. ``forward_step(chunk, micro_batch, input)``
    runs one chunk (``input`` is None where the chunk reads tokens) and returns the next stage's input,
    or the micro-batch's loss on the last virtual stage. ``backward_step(chunk, micro_batch, output,
    grad, last)`` runs its backward (``grad`` is None for a loss; ``last``: the chunk's last backward of
    the step, where gradient sync may start). Between two steps it makes one exchange: the sends the
    previous step produced with the receives the next one needs. Never touches the optimizer, the loss
    scale or gradient sync: the caller's steps do.
    """

    def __init__(self, exchange: StageExchange | None, stage: int, pp: int, vp: int):
        self.exchange, self.stage, self.pp, self.vp = exchange, stage, pp, vp

    def _first(self, chunk: int) -> bool:
        return self.stage == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.stage == self.pp - 1 and chunk == self.vp - 1

    def _exchange(self, sends: dict, step: tuple[Action, ...]) -> dict:
        """Post ``sends`` (the previous step's outputs) together with the receives ``step`` needs."""
        wanted = {"recv_forward": any(a.kind == "F" and not self._first(a.chunk) for a in step),
                  "recv_backward": any(a.kind == "B" and not self._last(a.chunk) for a in step)}
        if not (sends or any(wanted.values())):
            return {}
        forward, backward = self.exchange.exchange(**sends, **wanted)
        return {"F": forward, "B": backward}

    def run(self, steps: list[tuple[Action, ...]], forward_step: ForwardStep,
            backward_step: BackwardStep = plain_backward, train: bool = True) -> StepStats:
        stats = StepStats()
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        last_backward = {a.chunk: a.micro_batch for step in steps for a in step if a.kind == "B"}
        sends: dict = {}
        for step in steps:
            received = self._exchange(sends, step)
            sends = {}
            for action in step:
                key = (action.chunk, action.micro_batch)
                if action.kind == "F":
                    hidden = received.pop("F", None)
                    if hidden is not None and train:
                        hidden.requires_grad_()
                    with contextlib.nullcontext() if train else torch.no_grad():
                        output = forward_step(action.chunk, action.micro_batch, hidden)
                    if self._last(action.chunk):
                        stats.losses.append(output.detach())
                    else:
                        sends["send_forward"] = output
                    if train:
                        saved[key] = (hidden, output)
                        live = sum(1 for c, _ in saved if c == action.chunk)
                        stats.max_live_micro_batches[action.chunk] = max(
                            stats.max_live_micro_batches.get(action.chunk, 0), live)
                else:
                    hidden, output = saved.pop(key)
                    final = last_backward[action.chunk] == action.micro_batch
                    backward_step(action.chunk, action.micro_batch, output, received.pop("B", None), final)
                    if not self._first(action.chunk):
                        sends["send_backward"] = hidden.grad
                del hidden, output
            del received
        self._exchange(sends, ())
        return stats
