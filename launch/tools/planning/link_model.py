"""The link model: how long a step's data-parallel communication takes on a cluster's links.

Each collective of a ZeRO step is a ``Transfer``: the bytes each rank sends and the bytes that leave
the busiest node, both by ``parallel.comm``'s patterns over the real groups of the layout (a ring
collective sends a rank's bytes to the next rank of its group; an all-to-all sends each part to its
rank), so the model counts what the trainer's ``comm_bytes`` / ``comm_bytes_inter_node`` count. A transfer
takes ``max(per rank / intra-node bandwidth, leaving the node / inter-node bandwidth)`` plus a latency
per sequential message step: a node's ranks share its link to the other nodes.

``zero_transfers`` lists a step's data-parallel transfers for ZeRO stages 0-3 with ZeRO++'s options
(``ZeroCommOptions``: the secondary partition hpZ, quantized weights qwZ, quantized gradients qgZ) and
MiCS / HSDP shard groups, as ``parallel.zero`` sends them, each placed where it runs: in the forward
or the backward pass (the gathers a pass needs, the reductions it produces, the stage 1-2 gather the
next forward waits for module by module under --overlap-param-gather) or exposed (waited where it
starts: the replicas' all-reduce, tensor-parallel activations). ``step_seconds`` is the overlap
model: a pass takes the longer of its compute and the link time hidden behind it, and the rest of
every transfer adds on. Every collective of ``parallel.comm`` is posted whole and progressed by the
backend in the background (gloo's threads, NCCL's stream); on NCCL all of a transfer hides except a
pass's first gather / last reduction (one of its pieces: a unit, a layer each, at stage 3; a bucket
at stages 0-2), which has nothing to hide behind; on gloo nothing hides, as measured
(``hidden_share``). The backends also differ in how a gather or reduce-scatter travels: NCCL's around
its ring, gloo's directly (an equal part to every rank; ``parallel.comm``), which changes what leaves
a node. The quantize / dequantize passes are compute (``quantized_elements`` at a device's
``quantize_rate``). Predictions only: nothing here measures.
"""

from __future__ import annotations

import math
import functools
from collections import defaultdict
from dataclasses import dataclass, replace

from launch.tools.planning.devices import DeviceProfile
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
class Device:
    """What a device computes: model FLOP/s it sustains, elements per second it quantizes or dequantizes
    (ZeRO++'s passes), and the collective backend its ranks use ("nccl" or "gloo"); with a ``profile``
    (``launch.tools.planning.devices``) its achieved rates price the compute by shape instead of ``flops``."""

    flops: float = 300e12
    quantize_rate: float = 100e9
    backend: str = "nccl"
    profile: DeviceProfile | None = None


@dataclass(frozen=True)
class ZeroCommOptions:
    """ZeRO++, MiCS and overlap settings of a layout (the trainer's --zero-hpz-partition-size,
    --zero-quantized-weights, --zero-quantized-gradients, --zero-shard-size (None: dp) and
    --overlap-param-gather)."""

    hpz: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    shard_size: int | None = None
    overlap_param_gather: bool = False

    def label(self) -> str:
        parts = ([f"hpZ {self.hpz}"] * (self.hpz > 1) + ["qwZ"] * self.quantized_weights
                 + ["qgZ"] * self.quantized_gradients
                 + [f"shard {self.shard_size}"] * (self.shard_size is not None)
                 + ["overlap gather"] * self.overlap_param_gather)
        return " + ".join(parts) or "-"


@dataclass(frozen=True)
class Transfer:
    """One kind of collective of a step: what it is, bytes a rank sends, bytes that leave the busiest
    node, sequential message steps, how many times a step runs it, the pass it runs in ("forward",
    "backward", or "exposed": waited where it starts), the share of its link time that can run behind
    that pass's compute, and the elements it quantizes or dequantizes per run."""

    operation: str
    axis: str
    per_rank: float
    leaving_node: float
    steps: int
    count: int = 1
    phase: str = "exposed"
    overlap: float = 0.0
    quantized_elements: float = 0.0

    def seconds(self, links: Links) -> float:
        return self.count * (max(self.per_rank / links.intra_node, self.leaving_node / links.inter_node)
                             + self.steps * links.latency)


PASSES = ("forward", "backward")


def hidden_share(backend: str, pieces: int) -> float:
    """The share of a collective's link time that runs behind compute. NCCL: all of it but a pass's first
    gather (or last reduction), one of its ``pieces``, which has nothing to hide behind. gloo: none, as
    measured (``launch.bench.slow_link``: every configuration's step at 1 and 10 Gbit/s is its compute
    plus its link time, though the collectives progress in the background): the bytes are moved by
    threads on the cores the ranks compute on, and collectives in flight together share the link
    instead of queueing as on NCCL's stream, so the oldest, which compute waits for, ends last."""
    return 0.0 if backend == "gloo" else 1 - 1 / max(pieces, 1)


def _crossings(groups: list[list[int]], node_size: int | None, directly: bool) -> int:
    """The most sends that any node makes to other nodes when every rank of ``groups`` sends once to the next
    rank of its group (a ring), or ``directly`` once to every rank of it; nodes of ``node_size``
    consecutive ranks (None: one node)."""
    if node_size is None:
        return 0
    known = _CROSSINGS.get((id(groups), node_size, directly))
    if known is not None and known[0] is groups:  # the same kept groups (``Topology.group_tuples``)
        return known[1]
    count = _counted_crossings(tuple(map(tuple, groups)), node_size, directly)
    if isinstance(groups, tuple):
        if len(_CROSSINGS) > 4096:
            _CROSSINGS.clear()
        _CROSSINGS[(id(groups), node_size, directly)] = (groups, count)
    return count


_CROSSINGS: dict[tuple, tuple] = {}  # (id of kept groups, node size, directly) -> (the groups, the count)


@functools.lru_cache(maxsize=4096)
def _counted_crossings(groups: tuple[tuple[int, ...], ...], node_size: int, directly: bool) -> int:
    """``_crossings``, kept per grid: the planner prices thousands of layouts on a few of them."""
    leaving: dict[int, int] = defaultdict(int)
    for group in groups:
        for index, rank in enumerate(group):
            peers = group if directly else (group[(index + 1) % len(group)],)
            leaving[rank // node_size] += sum(1 for peer in peers if peer // node_size != rank // node_size)
    return max(leaving.values(), default=0)


def ring(operation: str, axis: str, groups: list[list[int]], node_size: int | None, per_rank: float,
         count: int = 1) -> Transfer:
    """A ring collective over ``groups`` in which every rank sends ``per_rank`` bytes to the next (nodes of
    ``node_size`` consecutive ranks; None: one node)."""
    size = len(groups[0])
    leaving = per_rank * _crossings(groups, node_size, directly=False) if size > 1 else 0.0
    return Transfer(operation, axis, per_rank if size > 1 else 0.0, leaving, size - 1, count)


def all_to_all(axis: str, groups: list[list[int]], node_size: int | None, input_bytes: float, count: int = 1,
               operation: str = "all_to_all") -> Transfer:
    """An all-to-all over ``groups`` of ``input_bytes`` per rank, an equal part to every rank (also what
    gloo's reduce-scatter is: ``operation``)."""
    size = len(groups[0])
    part = input_bytes / size
    leaving = part * _crossings(groups, node_size, directly=True)
    return Transfer(operation, axis, part * (size - 1), leaving, size - 1, count)


def zero_transfers(topology: Topology, params: int, stage: int, micro_batches: int, compute_bytes: int,
                   grad_bytes: int, options: ZeroCommOptions = ZeroCommOptions(),
                   node_size: int | None = None,
                   backend: str = "nccl", pieces: int = 1, bucket_size: int | None = None,
                   reused: int = 0, axis: str = "dp-cp") -> list[Transfer]:
    """The data-parallel transfers of one step for ``params`` parameters per rank (nodes of ``node_size``
    consecutive ranks; default the topology's --gpus-per-node, else one node) as they travel on
    ``backend``, placed in the passes they run in: stage 3's in ``pieces`` a pass (its units, a layer
    each; backward gathers all but the ``reused`` parameters that stay gathered from the end of forward),
    stages 0-2's in buckets of ``bucket_size`` elements (default: ``pieces`` of them). ``axis``: the groups
    the parameters are sharded over (data x context; "edp" for the experts of a mixture of experts, whose
    optimizer has no ZeRO++ options)."""
    node_size = node_size or topology.gpus_per_node or topology.world_size
    spans = topology.group_tuples(axis)  # gradients and ZeRO's shards span data x context (or expert dp)
    dp, m, label = len(spans[0]), micro_batches, "dp" if axis == "dp-cp" else axis
    shard = options.shard_size or dp
    shards, replicas = _partitions(topology, shard) if shard < dp else (spans, None)
    weight_bytes = QUANTIZED_BYTES if options.quantized_weights else compute_bytes
    part = params * (shard - 1) / shard
    dequantized = params * (1 + 1 / shard) if options.quantized_weights else 0.0  # own shard, then all of it
    split = pieces if stage == 3 or not bucket_size else -(-params // bucket_size)

    def collective(operation: str, axis: str, groups: list[list[int]], per_rank: float,
                   count: int = 1) -> Transfer:
        """A gather or reduce-scatter sending ``per_rank`` bytes a rank: around NCCL's ring, or directly to
        every rank on gloo (``parallel.comm``)."""
        size = len(groups[0])
        if backend == "gloo" and size > 1:
            return all_to_all(axis, groups, node_size, per_rank * size / (size - 1), count, operation)
        return ring(operation, axis, groups, node_size, per_rank, count)

    overlap = hidden_share(backend, split)

    def placed(transfer: Transfer, phase: str, quantized: float = 0.0) -> Transfer:
        return Transfer(transfer.operation, transfer.axis, transfer.per_rank, transfer.leaving_node,
                        transfer.steps, transfer.count, phase, overlap, quantized)

    if stage == 0:  # bucket by bucket in the last micro-batch's backward, by the backend's own all-reduce
        return [placed(ring("all_reduce", label, spans, node_size,
                            2 * grad_bytes * params * (dp - 1) / dp),
                       "backward")]
    transfers = []
    regathered = (params - reused) / params  # what backward gathers again at stage 3
    # a step's first gather of each unit over dp, the rest in the partition
    if stage == 3 and options.hpz > 1:
        secondary = _partitions(topology, options.hpz)[0]
        within = compute_bytes * params * (options.hpz - 1) / options.hpz
        transfers += [placed(collective("all_gather", label, shards, weight_bytes * part),
                             "forward", dequantized),
                      placed(collective("all_gather", f"dp_part{options.hpz}", secondary, within, m - 1),
                             "forward"),
                      placed(collective("all_gather", f"dp_part{options.hpz}", secondary, within * regathered,
                                        m), "backward")]
    elif stage == 3:  # every micro-batch's forward and backward
        transfers += [placed(collective("all_gather", label, shards, weight_bytes * part * share, m), phase,
                             dequantized * share)
                      for phase, share in zip(PASSES, (1.0, regathered))]
    else:  # stages 1-2: after the step (waited for by the next forward module by module if overlapped)
        transfers.append(placed(collective("all_gather", label, shards, weight_bytes * part),
                                "forward" if options.overlap_param_gather else "exposed",
                                quantized=dequantized))
    reductions = m if stage >= 2 else 1
    per_node = topology.dp_ranks_per_node(node_size)
    if options.quantized_gradients and stage >= 2:
        levels = [spans] if per_node in (1, dp) else list(_partitions(topology, per_node))
        elements = float(params)
        for index, groups in enumerate(levels):  # a level's next one starts as the next reduction starts
            transfers.append(placed(all_to_all("dp" if len(levels) == 1 else ("dp_part", "dp_replica")[index],
                                               groups, node_size, elements * QUANTIZED_BYTES, reductions),
                                    "backward", 2 * elements))
            elements /= len(groups[0])
    else:
        transfers.append(placed(collective("reduce_scatter", label, shards, grad_bytes * part, reductions),
                                "backward"))
    if replicas is not None:  # MiCS / HSDP: the gradient shards summed over the replicas once a step
        copies = dp // shard
        transfers.append(ring("all_reduce", f"dp_replica{shard}", replicas, node_size,
                              2 * grad_bytes * params / shard * (copies - 1) / copies))
    return [transfer for transfer in transfers if transfer.count > 0]


@functools.lru_cache(maxsize=1024)
def _partitions(topology: Topology, size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``Topology.dp_partitions``, kept per grid as tuples (``_crossings`` counts kept groups once)."""
    return tuple(tuple(map(tuple, groups)) for groups in topology.dp_partitions(size))


def zero_variants(stage: int, topology: Topology, gpus_per_node: int) -> list[ZeroCommOptions]:
    """ZeRO++ / MiCS settings worth trying at ``stage`` when data-parallel groups span nodes (K = the dp
    ranks of a node); at stages 1-2 each with and without the post-step gather behind the next forward."""
    if stage in (1, 2):
        return [replace(options, overlap_param_gather=overlap)
                for options in _zero_plus_plus(stage, topology, gpus_per_node) for overlap in (False, True)]
    return _zero_plus_plus(stage, topology, gpus_per_node)


def _zero_plus_plus(stage: int, topology: Topology, gpus_per_node: int) -> list[ZeroCommOptions]:
    k = topology.dp_ranks_per_node(gpus_per_node)
    if k == topology.dp_cp:  # every data-parallel group within one node
        return [ZeroCommOptions()]
    if stage == 2:
        return [ZeroCommOptions(), ZeroCommOptions(quantized_gradients=True)]
    if stage != 3:
        return [ZeroCommOptions()]
    if k == 1:  # one dp rank per node: no partition fits in a node, quantizing is what is left
        return [ZeroCommOptions(), ZeroCommOptions(quantized_weights=True, quantized_gradients=True)]
    return [ZeroCommOptions(), ZeroCommOptions(hpz=k), ZeroCommOptions(hpz=k, quantized_weights=True),
            ZeroCommOptions(hpz=k, quantized_weights=True, quantized_gradients=True),
            ZeroCommOptions(quantized_weights=True, quantized_gradients=True), ZeroCommOptions(shard_size=k)]


def step_seconds(transfers: list[Transfer], links: Links, compute: float, micro_batches: int,
                 quantize_rate: float = math.inf, forward_share: float = 1 / 3) -> float:
    """A step's time: ``compute`` seconds (all micro-batches; ``forward_share`` of it forward, a third
    without recompute; the quantize / dequantize passes at ``quantize_rate`` elements per second add to
    the pass they run in), each pass as long as the longer of its compute and the link time hidden
    behind it (a transfer hides at most behind the micro-batches it runs in), plus every transfer's
    time that cannot hide. Summed as: every transfer's time, plus the compute of each pass that the
    link time hidden in it does not cover."""
    compute = {"forward": compute * forward_share, "backward": compute * (1 - forward_share)}
    total = 0.0
    for transfer in transfers:
        quantizing = transfer.count * transfer.quantized_elements / quantize_rate
        if transfer.phase in compute:
            compute[transfer.phase] += quantizing
        else:
            total += quantizing
    hidden = dict.fromkeys(compute, 0.0)
    for transfer in transfers:
        seconds = transfer.seconds(links)
        total += seconds
        if transfer.phase in compute:
            hidden[transfer.phase] += min(transfer.overlap * seconds, compute[transfer.phase]
                                          * min(transfer.count, micro_batches) / micro_batches)
    return total + sum(max(compute[phase] - hidden[phase], 0.0) for phase in compute)


def parse_bandwidth(text: str) -> float:
    """'100Gbit', '10 Gbit/s', '1gbit' (tc's spelling), '25GB/s', '1e9' (bytes/s) -> bytes per second."""
    stripped = text.replace(" ", "").removesuffix("/s").removesuffix("ps")
    units = {"Tbit": 1e12 / 8, "Gbit": 1e9 / 8, "Mbit": 1e6 / 8, "TB": 1e12, "GB": 1e9, "MB": 1e6,
             "GiB": 2**30, "MiB": 2**20}
    for unit in sorted(units, key=len, reverse=True):
        if stripped.lower().endswith(unit.lower()) and (unit.endswith("bit") or stripped.endswith(unit)):
            return float(stripped[:-len(unit)]) * units[unit]
    return float(stripped)
