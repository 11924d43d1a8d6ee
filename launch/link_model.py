"""The link model: how long a step's data-parallel communication takes on a cluster's links.

Each collective of a ZeRO step is a ``Transfer``: the bytes each rank sends and the bytes that leave
the busiest node, both by ``parallel.comm``'s ring model over the real groups of the layout (a ring
collective sends a rank's bytes to the next rank of its group; an all-to-all sends each part to its
rank), so the model counts what the trainer's ``comm_bytes`` / ``comm_bytes_inter_node`` count. A transfer
takes ``max(per rank / intra-node bandwidth, leaving the node / inter-node bandwidth)`` plus a latency
per sequential message step: a node's ranks share its link to the other nodes.

``zero_transfers`` lists a step's data-parallel transfers for ZeRO stages 0-3 with ZeRO++'s options
(``ZeroOptions``: the secondary partition hpZ, quantized weights qwZ, quantized gradients qgZ) and
MiCS / HSDP shard groups, as ``parallel.zero`` sends them. Step time = compute + communication, summed:
gloo advances its rings only when waited on, so on CPUs little of it overlaps; on GPUs with NCCL the
sum is an upper bound. Predictions only: nothing here measures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from parallel.quantization import BLOCK
from parallel.topology import Topology

QUANTIZED_BYTES = 1 + 4 / BLOCK  # an int8 value and its share of the block's fp32 scale


@dataclass(frozen=True)
class Links:
    """Bandwidths in bytes per second (a rank to another rank of its node; a node to the others, shared
    by its ranks) and the latency of one message step in seconds."""

    intra_node: float
    inter_node: float
    latency: float = 0.0


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO++ and MiCS settings of a layout (the trainer's --zero-hpz-partition-size,
    --zero-quantized-weights, --zero-quantized-gradients, --zero-shard-size; None: dp)."""

    hpz: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    shard_size: int | None = None

    def label(self) -> str:
        parts = [f"hpZ {self.hpz}"] * (self.hpz > 1) + ["qwZ"] * self.quantized_weights \
            + ["qgZ"] * self.quantized_gradients + [f"shard {self.shard_size}"] * (self.shard_size is not None)
        return " + ".join(parts) or "-"


@dataclass(frozen=True)
class Transfer:
    """One kind of collective of a step: what it is, bytes a rank sends, bytes that leave the busiest
    node, sequential message steps, and how many times a step runs it."""

    operation: str
    axis: str
    per_rank: float
    leaving_node: float
    steps: int
    count: int = 1

    def seconds(self, links: Links) -> float:
        return self.count * (max(self.per_rank / links.intra_node, self.leaving_node / links.inter_node)
                             + self.steps * links.latency)


def _leaving(groups: list[list[int]], node, sent_to) -> float:
    """The most bytes any node sends to other nodes, ``sent_to(group, index)`` giving the (peer, bytes)
    pairs of the group's rank at ``index``."""
    leaving: dict[int, float] = defaultdict(float)
    for group in groups:
        for index, rank in enumerate(group):
            for peer, nbytes in sent_to(group, index):
                if node(peer) != node(rank):
                    leaving[node(rank)] += nbytes
    return max(leaving.values(), default=0.0)


def ring(operation: str, axis: str, groups: list[list[int]], node, per_rank: float, count: int = 1) -> Transfer:
    """A ring collective over ``groups`` in which every rank sends ``per_rank`` bytes to the next."""
    size = len(groups[0])
    leaving = _leaving(groups, node, lambda group, i: [(group[(i + 1) % size], per_rank)]) if size > 1 else 0.0
    return Transfer(operation, axis, per_rank if size > 1 else 0.0, leaving, size - 1, count)


def all_to_all(axis: str, groups: list[list[int]], node, input_bytes: float, count: int = 1) -> Transfer:
    """An all-to-all over ``groups`` of ``input_bytes`` per rank, an equal part to every rank."""
    size = len(groups[0])
    part = input_bytes / size
    leaving = _leaving(groups, node, lambda group, i: [(peer, part) for peer in group])
    return Transfer("all_to_all", axis, part * (size - 1), leaving, size - 1, count)


def zero_transfers(topology: Topology, params: int, stage: int, micro_batches: int, compute_bytes: int,
                   grad_bytes: int, options: ZeroOptions = ZeroOptions(), node_size: int | None = None) -> list[Transfer]:
    """The data-parallel transfers of one step for ``params`` parameters per rank (nodes of ``node_size``
    consecutive ranks; default the topology's --gpus-per-node, else one node)."""
    node_size = node_size or topology.gpus_per_node or topology.world_size
    node = lambda rank: rank // node_size  # noqa: E731
    dp, m = topology.dp, micro_batches
    shard = options.shard_size or dp
    shards, replicas = topology.dp_partitions(shard) if shard < dp else (topology.groups("dp"), None)
    weight_bytes = QUANTIZED_BYTES if options.quantized_weights else compute_bytes
    part = params * (shard - 1) / shard
    transfers = []
    if stage == 0:
        return [ring("all_reduce", "dp", topology.groups("dp"), node, 2 * grad_bytes * params * (dp - 1) / dp)]
    if stage == 3 and options.hpz > 1:  # a step's first gather of each unit over dp, the rest in the partition
        secondary = topology.dp_partitions(options.hpz)[0]
        transfers += [ring("all_gather", "dp", shards, node, weight_bytes * part),
                      ring("all_gather", f"dp_part{options.hpz}", secondary, node,
                           compute_bytes * params * (options.hpz - 1) / options.hpz, 2 * m - 1)]
    else:
        transfers.append(ring("all_gather", "dp", shards, node, weight_bytes * part, 2 * m if stage == 3 else 1))
    reductions = m if stage >= 2 else 1
    per_node = topology.dp_ranks_per_node(node_size)
    if options.quantized_gradients and stage >= 2:
        levels = [topology.groups("dp")] if per_node in (1, dp) else list(topology.dp_partitions(per_node))
        remaining = params * QUANTIZED_BYTES
        for index, groups in enumerate(levels):
            transfers.append(all_to_all("dp" if len(levels) == 1 else ("dp_part", "dp_replica")[index], groups,
                                        node, remaining, reductions))
            remaining /= len(groups[0])
    else:
        transfers.append(ring("reduce_scatter", "dp", shards, node, grad_bytes * part, reductions))
    if replicas is not None:  # MiCS / HSDP: the gradient shards summed over the replicas once a step
        copies = dp // shard
        transfers.append(ring("all_reduce", f"dp_replica{shard}", replicas, node,
                              2 * grad_bytes * params / shard * (copies - 1) / copies))
    return transfers


def communication_seconds(transfers: list[Transfer], links: Links) -> float:
    return sum(transfer.seconds(links) for transfer in transfers)


def parse_bandwidth(text: str) -> float:
    """'100Gbit', '10 Gbit/s', '1gbit' (tc's spelling), '25GB/s', '1e9' (bytes/s) -> bytes per second."""
    stripped = text.replace(" ", "").removesuffix("/s").removesuffix("ps")
    units = {"Tbit": 1e12 / 8, "Gbit": 1e9 / 8, "Mbit": 1e6 / 8, "TB": 1e12, "GB": 1e9, "MB": 1e6,
             "GiB": 2**30, "MiB": 2**20}
    for unit in sorted(units, key=len, reverse=True):
        if stripped.lower().endswith(unit.lower()) and (unit.endswith("bit") or stripped.endswith(unit)):
            return float(stripped[:-len(unit)]) * units[unit]
    return float(stripped)
