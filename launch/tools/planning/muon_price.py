"""What --optimizer muon adds to a layout's price (``launch.tools.planning``), as ``parallel.zero``'s Muon
runs it: one fp32 momentum per element of the layers' matrices (AdamW's two moments elsewhere), each
matrix orthogonalized whole on one owner (the owners' workspace, the Newton-Schulz time spread over the
dp x tp places, the pieces' trips to their owner and back). Nothing here searches layouts or prints."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from launch.tools.planning.layout import Layout
from launch.tools.planning.link_model import Transfer, all_to_all
from models.config import GPTConfig
from models.counting import stage_named_parameters
from parallel.muon import MuonSettings, orthogonalization_flops
from parallel.param_meta import meta
from parallel.topology import Topology
from pretrain.training.param_groups import takes_muon

SETTINGS = MuonSettings()  # Megatron's defaults: 5 quintic steps, q, k and v apart


def named_parameters(config: GPTConfig, layout: Layout, stage: int) -> tuple[tuple[str, nn.Parameter], ...]:
    """Pipeline ``stage``'s parameters on one tp rank, with their names."""
    return stage_named_parameters(config, layout.tp, layout.pp, stage, layout.sequence_parallel,
                                  list(layout.split) if layout.split else None, (layout.ep, layout.expert_tp),
                                  layout.v, layout.chunks)


def moments(layout: Layout, named: tuple[tuple[str, nn.Parameter], ...]) -> Callable[[nn.Parameter], int]:
    """The fp32 optimizer states per element of each parameter under ``layout.optimizer``."""
    if layout.optimizer == "sgd":
        return lambda param: 1
    if layout.optimizer != "muon":
        return lambda param: 2
    muon = {id(param) for name, param in named if takes_muon(name, param)}
    return lambda param: 1 if id(param) in muon else 2


def _matrices(config: GPTConfig, layout: Layout, stage: int) -> list[tuple[int, int, bool, int]]:
    """(elements on this tp rank, Newton-Schulz FLOPs of the whole matrix, expert?, the iteration's
    temporaries of the whole matrix: its update and next iterate, 2 m n, the Gram matrix and its square,
    2 s^2 for its short side s) of each Muon matrix of ``stage``."""
    found = []
    for name, param in named_parameters(config, layout, stage):
        if not takes_muon(name, param):
            continue
        declared, shape = meta(param), list(param.shape)
        tp = layout.expert_tp if declared.expert else layout.tp
        if declared.tensor_parallel:
            shape[declared.partition_dim] *= tp
        flops = orthogonalization_flops(torch.Size(shape), declared.fused_rows, SETTINGS)
        rows, columns = math.prod(shape[:-1]), shape[-1]
        temporaries = 2 * rows * columns + 2 * min(rows, columns) ** 2
        found.append((param.numel(), flops, declared.expert, temporaries))
    return found


def newton_schulz_flops(config: GPTConfig, layout: Layout, stage: int) -> float:
    """Newton-Schulz FLOPs per step on one rank of ``stage``: every matrix's once, spread evenly over the
    places that own them (dp x tp; expert dp x expert tp for experts). Not in the model's FLOPs (MFU)."""
    if layout.optimizer != "muon":
        return 0.0
    dense = layout.data_ranks * layout.tp
    expert = layout.expert_data_ranks * layout.expert_tp
    return sum(flops / (expert if is_expert else dense)
               for _, flops, is_expert, _ in _matrices(config, layout, stage))


def workspace_bytes(config: GPTConfig, layout: Layout, stage: int) -> float:
    """The owners' fp32 buffers on one rank: its share of the stage's matrices gathered whole, and the
    iteration's temporaries of the largest (``_matrices``)."""
    if layout.optimizer != "muon":
        return 0.0
    found = _matrices(config, layout, stage)
    if not found:
        return 0.0
    share = sum(elements for elements, *_ in found) / layout.data_ranks
    return 4.0 * (share + max(temporaries for *_, temporaries in found))


def muon_transfers(config: GPTConfig, layout: Layout, topology: Topology,
                   gpus_per_node: int | None, stage: int = 0) -> list[Transfer]:
    """What one rank of pipeline ``stage`` sends per step for Muon, for P matrix elements on its tp rank: at
    stage 0 the owners send each whole result to the d - 1 others, 4 P (d - 1) / d bytes; at stages 1-3 at
    most 8 P (d - 1) / d^2, each rank's pieces of the matrices others own and the others' pieces of its
    own back, as if no owner held any of its matrix. An upper bound: owners are chosen where a matrix
    lies, and ZeRO's buckets and units keep most matrices whole on one rank (``launch.bench.muon``: none
    travelled at ZeRO-1, 29% and 78% of the bound at ZeRO-3 dp 2 and 4). Under tp, the whole matrices'
    shards to their tp owner and back, 8 P (t - 1) / (t d)."""
    if layout.optimizer != "muon":
        return []
    elements = sum(count for count, _, is_expert, _ in _matrices(config, layout, stage) if not is_expert)
    d, t = layout.data_ranks, layout.tp
    found = []
    per_rank = 4 * elements * (d - 1) / d if layout.zero_stage == 0 else 8 * elements * (d - 1) / d ** 2
    if d > 1:
        found.append(all_to_all("dp", topology.group_tuples("dp-cp"), gpus_per_node, per_rank * d / (d - 1)))
    if t > 1:
        found.append(all_to_all("tp", topology.group_tuples("tp"), gpus_per_node, 8 * elements / d))
    return found
