"""The executor that runs one pipeline rank's program: its schedule's actions with the exchanges
``parallel.pipeline.timeline`` placed between them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel.pipeline.p2p import BACKWARD, FORWARD, PostedBatch, StageExchange
from parallel.pipeline.schedules import Action
from parallel.pipeline.partition import virtual_stage
from parallel.pipeline.timeline import Exchange


@dataclass
class StepStats:
    """What the executor measured in one step: the losses (last stage; device tensors, read once the
    step ends, so the host never waits for a micro-batch) and activation residency."""

    losses: list[torch.Tensor] = field(default_factory=list)
    max_live_micro_batches: dict[int, int] = field(default_factory=dict)


ForwardStep = Callable[[int, int, torch.Tensor | None], torch.Tensor]
BackwardStep = Callable[[int, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool],
                        torch.Tensor | None]
WeightStep = Callable[[int, int, bool], None]


def plain_backward(chunk: int, micro_batch: int, output: torch.Tensor, grad: torch.Tensor | None,
                   hidden: torch.Tensor | None, last: bool) -> torch.Tensor | None:
    torch.autograd.backward(output, grad)
    return None if hidden is None else hidden.grad


class PipelineExecutor:
    """Runs a program (``Timeline.program``) on this stage's model chunks.

    Owns the activations kept between a micro-batch's forward and its backward (input and output of
    each chunk) and releases them right after the backward, and the tensors between their producing
    action and their exchange. ``forward_step(chunk, micro_batch, input)`` runs one chunk (``input`` is
    None where the chunk reads tokens) and returns the next stage's input, or the micro-batch's loss on
    the last virtual stage. ``backward_step(chunk, micro_batch, output, grad, input, last)`` runs its
    backward (``grad`` is None for a loss) and returns the input's gradient; ``weight_step(chunk,
    micro_batch, last)`` runs a split backward's weight pass. ``last``: the chunk's last backward (or weight
    pass) of the step, where gradient sync may start. Never touches the optimizer, the loss scale or
    gradient sync: the caller's steps do.
    """

    def __init__(self, exchange: StageExchange | None, stage: int, pp: int, vp: int, v: bool = False):
        self.exchange, self.stage, self.pp, self.vp, self.v = exchange, stage, pp, vp, v

    def _exchange(self, item: Exchange, outbox: dict, inbox: dict, sending: list[PostedBatch]) -> None:
        """Post ``item``'s batch; a batch that receives is waited for where its tensors are used, one that
        only sends at the next exchange (``sending``)."""
        for batch in sending:
            self.exchange.wait(batch)
        sending.clear()
        tags = {"F": FORWARD, "B": BACKWARD}
        sends = [(outbox.pop(t.key), t.target, tags[t.kind])
                 for t in item.transfers if t.source == self.stage]
        wanted = [t for t in item.transfers if t.target == self.stage]
        batch = self.exchange.post(sends, [(t.source, tags[t.kind]) for t in wanted])
        if not wanted:
            sending.append(batch)
        inbox.update((t.key, (batch, tensor)) for t, tensor in zip(wanted, batch.received))

    def _take(self, key: tuple[str, int, int], inbox: dict, outbox: dict) -> torch.Tensor | None:
        """The tensor ``key`` from a neighbour (its batch waited for now) or from this rank's own chunk."""
        if key not in inbox:
            return outbox.pop(key, None)
        batch, tensor = inbox.pop(key)
        self.exchange.wait(batch)
        return tensor

    def run(self, program: list[Action | Exchange], forward_step: ForwardStep,
            backward_step: BackwardStep = plain_backward, weight_step: WeightStep | None = None,
            train: bool = True) -> StepStats:
        stats = StepStats()
        stages = self.pp * self.vp
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        actions = [a for a in program if isinstance(a, Action)]
        closing = "W" if any(a.kind == "W" for a in actions) else "B"
        last_of_chunk = {a.chunk: a.micro_batch for a in actions if a.kind == closing}
        outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # produced, not yet sent (or taken locally)
        inbox: dict[tuple[str, int, int], tuple[PostedBatch, torch.Tensor]] = {}  # posted receives
        sending: list[PostedBatch] = []  # posted batches that only send
        for item in program:
            if isinstance(item, Exchange):
                self._exchange(item, outbox, inbox, sending)
                continue
            key = (item.chunk, item.micro_batch)
            virtual = virtual_stage(self.stage, item.chunk, self.pp, self.v)
            last = item.kind == closing and last_of_chunk[item.chunk] == item.micro_batch
            if item.kind == "F":
                hidden = self._take(("F", virtual - 1, item.micro_batch), inbox, outbox)
                if hidden is not None and train:
                    hidden = hidden.detach().requires_grad_()
                with contextlib.nullcontext() if train else torch.no_grad():
                    output = forward_step(item.chunk, item.micro_batch, hidden)
                if virtual == stages - 1:
                    stats.losses.append(output.detach())
                else:
                    outbox[("F", virtual, item.micro_batch)] = output
                if train:
                    saved[key] = (hidden, output)
                    live = sum(1 for c, _ in saved if c == item.chunk)
                    stats.max_live_micro_batches[item.chunk] = max(
                        stats.max_live_micro_batches.get(item.chunk, 0), live)
            elif item.kind == "B":
                hidden, output = saved.pop(key)
                grad = self._take(("B", virtual + 1, item.micro_batch), inbox, outbox)
                input_grad = backward_step(item.chunk, item.micro_batch, output, grad, hidden, last)
                if virtual > 0:
                    outbox[("B", virtual, item.micro_batch)] = input_grad
                del hidden, output, grad, input_grad
            else:
                weight_step(item.chunk, item.micro_batch, last)
        for batch in sending:
            self.exchange.wait(batch)
        if outbox or inbox:
            raise RuntimeError(f"pipeline program left tensors unexchanged: {sorted(outbox)} {sorted(inbox)}")
        return stats
