"""Each multi-token prediction depth's loss in a step, for the metrics line (Megatron's ``mtp_1 loss``
..): the mean over the step's micro-batches and data-parallel ranks."""

from __future__ import annotations

import torch

from parallel import comm
from parallel.process_groups import ParallelGroups


def mtp_metrics(losses: torch.Tensor, groups: ParallelGroups) -> dict:
    """``mtp_{k} loss`` from the last stage's per-depth ``losses`` (the pipeline runner's): a collective
    over data and context parallelism and the pipeline (every rank calls it once per logged step); nothing
    without depths."""
    if not losses.numel():
        return {}
    values = losses.clone()
    comm.all_reduce(values, groups.dp_cp)  # (a cp rank's are its share of the whole sequences')
    comm.broadcast(values, src=groups.pp.ranks[groups.topology.last_stage], group=groups.pp)
    return {f"mtp_{depth} loss": value / groups.topology.dp for depth, value in enumerate(values.tolist(), 1)}
