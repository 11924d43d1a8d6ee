"""What a mixture of experts did in a step, for the metrics line: each balancing loss (mean per MoE layer
and micro-batch, over the whole global batch) and how evenly each layer's experts were loaded (the most
tokens an expert received over the mean, 1.0 when perfectly even)."""

from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.process_groups import ParallelGroups

LOSSES = ("aux_loss", "seq_aux_loss", "z_loss")


def moe_metrics(chunks: nn.ModuleList, groups: ParallelGroups, moe_layers: list[bool], num_experts: int,
                micro_batches: int, device: torch.device) -> dict:
    """``moe_<loss>`` for each balancing loss the layers have, ``moe_load_max_over_mean`` per MoE layer
    and its worst: a collective over the world (every rank calls it once per logged step)."""
    layers, kinds = len(moe_layers), len(LOSSES)
    # the losses, whether a rank has each (a middle stage may hold no MoE layer), tokens per expert per layer
    values = torch.zeros(2 * kinds + layers * num_experts, dtype=torch.float64, device=device)
    counts = values[2 * kinds:].view(layers, num_experts)
    balancing = chunks[0].balancing  # the rank's, shared by its chunks
    for index, kind in enumerate(LOSSES):
        if kind in balancing.losses:
            values[index] = balancing.losses[kind].to(device)
            values[kinds + index] = 1.0
    for layer, tokens in balancing.tokens_per_expert.items():
        counts[layer] = tokens.to(device)
    # tp x cp shares of each loss, distinct tokens on each rank of a stage: sums (stages hold other layers)
    comm.all_reduce(values, groups.world)
    moe = sum(moe_layers)
    losses = (values[:kinds] / (groups.topology.dp * moe * micro_batches)).tolist()
    present = values[kinds:2 * kinds].tolist()
    record = {f"moe_{kind}": losses[index] for index, kind in enumerate(LOSSES) if present[index]}
    load = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
    per_layer = [round(load[layer].item(), 4) for layer in range(layers) if moe_layers[layer]]
    record["moe_load_max_over_mean"] = per_layer
    record["moe_load_max_over_mean_worst"] = max(per_layer)
    return record

