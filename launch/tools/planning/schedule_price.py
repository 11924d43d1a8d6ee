"""What a layout's pipeline schedule costs: the bubble, and the activations a stage holds at its peak, read
off every stage's order laid out in time (``parallel.pipeline.timeline``) with the layout's cost of each
action.

A virtual stage's forward of a micro-batch costs F = M + A over its layers (M: their weight products, A:
the attention scores and weighted sum, ``models.counting.forward_flops_parts``), the last one's also the
output layer's products (and the prediction depths' products and mixing); the input-gradient pass
B = M + 2 A (plus F under full recompute, which rebuilds the forward inside it), the weight pass W = M; a
backward that is not split costs B + W. So an uneven cut (``parallel.pipeline.partition``) is laid out
with what each of its stages does. A (chunk, micro-batch) holds its saved activations from its forward
to its backward and, split, what its weight pass needs (the products' operands and the other parameters'
gradients) from B to W. The timeline is exact for these costs; how close they are to a device's is the
benchmark's to say (``launch.bench.pipeline``). A stage's idle time and its peak no longer change once
the steady state repeats, so a step of more than ``4 pp`` micro-batches is laid out with ``4 pp`` and
each stage's busy time extended.
"""

from __future__ import annotations

import functools

from models.config import GPTConfig
from models.counting import forward_flops_parts, frozen_config, thawed_config
from parallel.pipeline.partition import chunk_layers
from parallel.pipeline.schedules import V_SCHEDULES, schedule_actions
from parallel.pipeline.timeline import Timeline, simulate

SCHEDULES = ("1f1b", "zb-h1", "zbv", "interleaved")  # the schedules the planner prices


def chunks_of(schedule: str, vp: int = 1) -> int:
    """Model chunks per stage: two in a V, ``vp`` interleaved, else one."""
    return 2 if schedule in V_SCHEDULES else vp


def stage_costs(config: GPTConfig, recompute: str | None, pp: int, chunks: int = 1,
                split: tuple[int, ...] | None = None) -> tuple[tuple[float, float, float], ...]:
    """(F, B, W) of each virtual stage's micro-batch, in a token's FLOPs (see the module docstring)."""
    return _stage_costs(frozen_config(config), recompute, pp, chunks, split)


@functools.lru_cache(maxsize=4096)
def _stage_costs(frozen: tuple, recompute: str | None, pp: int, chunks: int,
                 split: tuple[int, ...] | None) -> tuple[tuple[float, float, float], ...]:
    config = thawed_config(frozen)
    layers, head = forward_flops_parts(config)
    stages, found = pp * chunks, []
    for virtual in range(stages):
        indices = chunk_layers(config.num_layers, stages, virtual, 0, 1, split)
        last = virtual == stages - 1
        matmul = sum(layers[i][0] for i in indices) + (head[0] if last else 0.0)
        attention = sum(layers[i][1] for i in indices) + (head[1] if last else 0.0)
        forward = matmul + attention
        found.append((forward, matmul + 2 * attention + (forward if recompute == "full" else 0.0), matmul))
    return tuple(found)


@functools.lru_cache(maxsize=512)
def timeline(schedule: str, micro_batches: int, pp: int, costs: tuple[tuple[float, float, float], ...]) \
        -> Timeline:
    """Every stage's order of ``schedule`` laid out with ``costs`` (F, B, W) per virtual stage's action."""
    vp = len(costs) // pp
    orders = [schedule_actions(schedule, micro_batches, pp, stage, vp) for stage in range(pp)]
    return simulate(orders, pp, vp, [dict(zip("FBW", cost)) for cost in costs], v=schedule in V_SCHEDULES)


def _laid_out(micro_batches: int, pp: int) -> int:
    return min(micro_batches, 4 * pp)


@functools.lru_cache(maxsize=4096)
def pipeline_time(schedule: str, pp: int, micro_batches: int,
                  costs: tuple[tuple[float, float, float], ...]) -> tuple[float, float]:
    """(the bubble: the fraction of a step the busiest stage waits, the imbalance: its work over a stage's
    mean) of ``micro_batches`` run by ``schedule`` with ``costs`` per virtual stage."""
    if pp == 1:
        return 0.0, 1.0
    laid_count = _laid_out(micro_batches, pp)
    laid = timeline(schedule, laid_count, pp, costs)
    scale = micro_batches / laid_count
    busy = [laid.busy(stage) * scale for stage in range(pp)]
    step = max(laid.step_time - laid.busy(stage) + busy[stage] for stage in range(pp))
    busiest = max(busy)
    return 1 - busiest / step, busiest / (sum(busy) / pp)


def pipeline_bubble(config: GPTConfig, schedule: str, pp: int, micro_batches: int, recompute: str | None,
                    split: tuple[int, ...] | None = None, vp: int = 1) -> float:
    """The fraction of a step the busiest stage waits."""
    return pipeline_time(schedule, pp, micro_batches,
                         stage_costs(config, recompute, pp, chunks_of(schedule, vp), split))[0]


def held_bytes(schedule: str, pp: int, stage: int, micro_batches: int, saved: tuple[float, ...],
               pending: tuple[float, ...]) -> float:
    """The most ``stage`` holds at once: ``saved`` per micro-batch from forward to backward and ``pending``
    from a split backward to its weight pass, one of each per chunk of the stage."""
    laid = timeline(schedule, _laid_out(micro_batches, pp), pp, ((1.0, 1.0, 1.0),) * (pp * len(saved)))
    return laid.peak_held(stage, saved, pending)
