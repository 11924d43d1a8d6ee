"""Every pipeline rank's schedule laid out in time at once: when each action runs, how long each stage
waits, how many micro-batches it holds, and where the neighbours exchange tensors.

``simulate`` runs the ranks' orders (``parallel.pipeline.schedules``) against each other with a cost
per kind of action and no transfer time: an action starts when its rank is free and its input is there
(a forward needs the previous virtual stage's forward of the micro-batch, a backward the next one's
backward, or its own forward on the last virtual stage, a weight pass its own backward). A backward
that is not split from its weight pass (no W in the schedule) costs B + W.

The same layout, with unit costs, fixes the exchanges (``Timeline.program``): a transfer happens at the
tick its producer ends, and both ranks post it in their batch of that tick, placed after the rank's
actions that started earlier and before those that start then or later. Every rank therefore meets
its batches in the one global order of the ticks, and each batch's operations are matched by the
peers' batches of the same tick: on NCCL, where a rank's point-to-point batches run one after another
and a send completes only when received, no batch can wait on one the peer posts later. The planner
reads the same layout with measured costs for the bubble and the activations a stage holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from parallel.pipeline.partition import stage_of, virtual_stage
from parallel.pipeline.schedules import Action

UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Transfer:
    """A tensor between two pipeline ranks: the activation ("F") a virtual stage's forward sends to the
    next, or the input gradient ("B") its backward sends to the previous one, at ``tick``."""

    kind: str
    virtual: int  # the producer's virtual stage
    micro_batch: int
    source: int
    target: int
    tick: float

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.virtual, self.micro_batch


@dataclass(frozen=True)
class Exchange:
    """The transfers a rank posts as one batch at ``tick`` (sends and receives, in one order on both
    sides)."""

    tick: float
    transfers: tuple[Transfer, ...]


@dataclass
class Timeline:
    """The ranks' actions with their start and end times. Owns nothing but the layout; runs nothing."""

    pp: int
    vp: int
    v: bool  # the chunks placed in a V
    orders: list[list[Action]]
    starts: list[list[float]] = field(default_factory=list)
    ends: list[list[float]] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    _counts: dict[int, set] = field(default_factory=dict, repr=False)

    @property
    def step_time(self) -> float:
        return max(ends[-1] for ends in self.ends if ends)

    def busy(self, stage: int) -> float:
        return sum(end - start for start, end in zip(self.starts[stage], self.ends[stage]))

    def bubble(self, stage: int) -> float:
        """The fraction of the step ``stage`` spends waiting."""
        return 1.0 - self.busy(stage) / self.step_time

    def peak_live(self, stage: int) -> int:
        """The most micro-batches (over all chunks) whose forward has run on ``stage`` and whose backward
        has not ended: a split backward holds them until its weight pass."""
        return round(self.peak_held(stage, 1.0, 1.0))

    def peak_held(self, stage: int, saved: float | tuple[float, ...],
                  pending: float | tuple[float, ...]) -> float:
        """The most ``stage`` holds at once when a (chunk, micro-batch) holds ``saved`` from its forward to
        its backward and ``pending`` from a split backward to its weight pass (the weight products'
        operands and the gradients kept for W); each a number, or one per chunk (chunks of unequal
        layers)."""
        saved = saved if isinstance(saved, tuple) else (saved,) * self.vp
        pending = pending if isinstance(pending, tuple) else (pending,) * self.vp
        return max(sum(f * s + w * p for f, w, s, p in zip(full, waiting, saved, pending))
                   for full, waiting in self._held_counts(stage))

    def _held_counts(self, stage: int) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Every (micro-batches between forward and backward, between B and W), per chunk, ``stage``
        passes through."""
        if stage not in self._counts:
            full, waiting = [0] * self.vp, [0] * self.vp
            counts = {(tuple(full), tuple(waiting))}
            for action in self.orders[stage]:
                full[action.chunk] += {"F": 1, "B": -1, "W": 0}[action.kind]
                waiting[action.chunk] += {"F": 0, "B": 1 if self.split else 0, "W": -1}[action.kind]
                counts.add((tuple(full), tuple(waiting)))
            flat = [full + waiting for full, waiting in counts]  # a count another covers is never the peak
            self._counts[stage] = {count for count, values in zip(counts, flat)
                                   if not any(other != values and all(o >= v for o, v in zip(other, values))
                                              for other in flat)}
        return self._counts[stage]

    @functools.cached_property
    def split(self) -> bool:
        """Whether the backwards are split from their weight passes."""
        return any(a.kind == "W" for order in self.orders for a in order)

    def program(self, stage: int) -> list[Action | Exchange]:
        """``stage``'s actions with its exchanges between them (see the module docstring)."""
        batches: dict[float, list[Transfer]] = {}
        for transfer in self.transfers:
            if stage in (transfer.source, transfer.target):
                batches.setdefault(transfer.tick, []).append(transfer)
        exchanges = [Exchange(tick, tuple(sorted(items, key=lambda t: (t.kind, t.virtual, t.micro_batch))))
                     for tick, items in sorted(batches.items())]
        program: list[Action | Exchange] = []
        for action, start in zip(self.orders[stage], self.starts[stage]):
            while exchanges and exchanges[0].tick <= start:
                program.append(exchanges.pop(0))
            program.append(action)
        return program + exchanges


def _input_of(action: Action, virtual: int, stages: int) -> tuple[str, int, int] | None:
    """The (kind, virtual stage, micro-batch) whose end ``action`` (at ``virtual``) waits for."""
    if action.kind == "F":
        return ("F", virtual - 1, action.micro_batch) if virtual > 0 else None
    if action.kind == "W":
        return "B", virtual, action.micro_batch
    if virtual < stages - 1:
        return "B", virtual + 1, action.micro_batch
    return "F", virtual, action.micro_batch


def simulate(orders: list[list[Action]], pp: int, vp: int = 1,
             costs: dict[str, float] | list[dict[str, float]] | None = None, v: bool = False) -> Timeline:
    """Lay out ``orders`` (one per pipeline rank; ``v``: their chunks placed in a V) in time; ``costs`` per
    kind (default: one each), or one such dict per virtual stage (stages of unequal work). Raises
    ValueError if the orders deadlock (a rank waits for an action that waits for it). A tensor between two
    chunks of one rank is no transfer."""
    stages = pp * vp
    per_stage = costs if isinstance(costs, list) else [costs or UNIT_COSTS] * stages
    timeline = Timeline(pp, vp, v, orders, [[] for _ in orders], [[] for _ in orders])
    cost = [{"F": c["F"], "W": c["W"], "B": c["B"] if timeline.split else c["B"] + c["W"]} for c in per_stage]
    ended: dict[tuple[str, int, int], float] = {}
    clocks, positions = [0.0] * pp, [0] * pp
    while any(positions[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for rank, order in enumerate(orders):
            while positions[rank] < len(order):
                action = order[positions[rank]]
                virtual = virtual_stage(rank, action.chunk, pp, v)
                needed = _input_of(action, virtual, stages)
                if needed is not None and needed not in ended:
                    break
                start = max(clocks[rank], ended.get(needed, 0.0))
                end = start + cost[virtual][action.kind]
                clocks[rank] = ended[(action.kind, virtual, action.micro_batch)] = end
                timeline.starts[rank].append(start)
                timeline.ends[rank].append(clocks[rank])
                positions[rank] += 1
                moved = True
                neighbour = {"F": virtual + 1, "B": virtual - 1}.get(action.kind)
                if neighbour is not None and 0 <= neighbour < stages and stage_of(neighbour, pp, v) != rank:
                    timeline.transfers.append(Transfer(action.kind, virtual, action.micro_batch, rank,
                                                       stage_of(neighbour, pp, v), clocks[rank]))
        if not moved:
            stuck = {rank: orders[rank][positions[rank]] for rank in range(pp)
                     if positions[rank] < len(orders[rank])}
            raise ValueError(f"the pipeline schedule deadlocks: each stage waits ({stuck})")
    return timeline
