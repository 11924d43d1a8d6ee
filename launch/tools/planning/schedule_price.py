"""What a layout's pipeline schedule costs: the bubble, and the activations a stage holds at its peak, read
off every stage's order laid out in time (``parallel.pipeline.timeline``) with the layout's cost of each
action.

A stage's forward of a micro-batch costs F = M + A (M: its layers' weight products, A: the attention scores
and weighted sum, ``models.counting.forward_flops_per_token``), the input-gradient pass B = M + 2 A (plus F
under full recompute, which rebuilds the forward inside it), the weight pass W = M; a backward that is not
split costs B + W. With zbv each action is one of the stage's two chunks, half of it. A (chunk, micro-batch)
holds its saved activations from its forward to its backward and, split, what its weight pass needs (the
products' operands and the other parameters' gradients) from B to W. The timeline is exact for these costs;
how close they are to a device's is the benchmark's to say (``launch.bench.pipeline``). A stage's idle time
and its peak no longer change once the steady state repeats, so a step of more than ``4 pp`` micro-batches
is laid out with ``4 pp`` and its busy time extended.
"""

from __future__ import annotations

import functools

from models.config import GPTConfig
from models.counting import forward_flops_per_token
from parallel.pipeline.schedules import V_SCHEDULES, schedule_actions
from parallel.pipeline.timeline import Timeline, simulate

SCHEDULES = ("1f1b", "zb-h1", "zbv")  # the schedules the planner compares


def schedules_for(config: GPTConfig, pp: int, even: bool = True) -> tuple[str, ...]:
    """The schedules a layout of ``pp`` stages can run (``even``: the layers split evenly): ZB-H1 on any
    pipeline, ZBV where the layers cut into 2 pp equal chunks."""
    if pp == 1:
        return ("1f1b",)
    zbv = even and config.num_layers % (2 * pp) == 0
    return ("1f1b", "zb-h1") + (("zbv",) if zbv else ())


def action_costs(config: GPTConfig, recompute: str | None) -> tuple[float, float, float]:
    """(F, B, W) of a stage's micro-batch, in a token's forward FLOPs (see the module docstring)."""
    matmul, attention = forward_flops_per_token(config)
    forward = matmul + attention
    return forward, matmul + 2 * attention + (forward if recompute == "full" else 0.0), matmul


@functools.lru_cache(maxsize=512)
def timeline(schedule: str, micro_batches: int, pp: int, costs: tuple[float, float, float]) -> Timeline:
    """Every stage's order of ``schedule`` laid out with ``costs`` (F, B, W) per stage's action."""
    vp = 2 if schedule in V_SCHEDULES else 1
    orders = [schedule_actions(schedule, micro_batches, pp, stage, vp) for stage in range(pp)]
    return simulate(orders, pp, vp, dict(zip("FBW", (cost / vp for cost in costs))), v=vp == 2)


def _laid_out(micro_batches: int, pp: int) -> int:
    return min(micro_batches, 4 * pp)


def pipeline_bubble(config: GPTConfig, schedule: str, pp: int, micro_batches: int,
                    recompute: str | None) -> float:
    """The largest fraction of a step a stage waits."""
    if pp == 1:
        return 0.0
    costs = action_costs(config, recompute)
    laid = timeline(schedule, _laid_out(micro_batches, pp), pp, costs)
    idle = max(laid.step_time - laid.busy(stage) for stage in range(pp))
    return idle / (idle + micro_batches * sum(costs))


def held_bytes(schedule: str, pp: int, stage: int, micro_batches: int, saved: float, pending: float) -> float:
    """The most ``stage`` holds at once: ``saved`` per micro-batch from forward to backward and ``pending``
    from a split backward to its weight pass (the stage's whole; a zbv chunk holds half)."""
    vp = 2 if schedule in V_SCHEDULES else 1
    laid = timeline(schedule, _laid_out(micro_batches, pp), pp, (1.0, 1.0, 1.0))
    return laid.peak_held(stage, saved / vp, pending / vp)
