"""Torch process groups for one rank, created from a ``Topology``.

``init_distributed()`` starts the default group from the launcher's environment (torchrun sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): gloo on CPU, NCCL when a GPU is present.
``create_process_groups(topology)`` then makes every tp, cp, dp, dp-cp, pp, mp and embedding group (every rank
creates every group in the same order, as torch requires) and returns this rank's ``ParallelGroups``,
which is passed explicitly to whatever needs a group: there are no module-level globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.comm import AxisGroup, CommStats
from parallel.topology import AXES, EXPERT_AXES, Topology


def default_device() -> torch.device:
    """This process's compute device: its local GPU when one exists, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def module_device(module: nn.Module) -> torch.device:
    """Where the module computes; a module built on the meta device is materialised on this process's
    default device."""
    device = next(module.parameters()).device
    if device.type == "meta":
        return default_device()
    return device


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Initialise the default process group from the launcher's environment; return the device.

    Without launcher variables it starts a world of one process (so the main job also runs as a
    plain ``python -m pretrain``). Unless OMP_NUM_THREADS is set, the CPU cores are divided among the
    processes of this node. Safe to call when the group already exists.
    """
    device = default_device()
    if "OMP_NUM_THREADS" not in os.environ:  # oversubscribed intra-op threads spin and crawl
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # on GPUs, CPU tensors (offloaded states, small metrics) still get a gloo backend
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                store=attempt_store(store), rank=rank, world_size=world_size, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def attempt_store(store):
    """The store this attempt's process groups form on. Where torchrun's agent shares its own store with the
    workers (plain torchrun: its static rendezvous, or c10d without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the
    launchers' setting) that store outlives every attempt, and a restarted world would read the last one's
    addresses (gloo's connectFullMesh refused, or both ranks waited out the start; pytorch/pytorch#135712):
    this attempt's keys go under its restart count. Elsewhere rank 0 hosts a store of this attempt's own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return store
    return dist.PrefixStore(f"attempt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown_distributed() -> None:
    """Tear the process groups down (their background threads must not outlive the interpreter)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rendezvous_store():
    """The default group's store (torch keeps it private), or None where there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a rendezvous on this machine)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ParallelGroups:
    """This rank's place in the grid: its coordinates and one ``AxisGroup`` per axis.

    Owns the group handles and the process-wide communication counters (``stats``). It never
    decides layout (that is ``Topology``) and never communicates by itself (that is ``parallel.comm``).
    """

    topology: Topology
    rank: int
    stats: CommStats
    tp: AxisGroup
    cp: AxisGroup
    dp: AxisGroup
    dp_cp: AxisGroup  # data x context: the gradients' and ZeRO's group (the dp group itself when cp = 1)
    pp: AxisGroup
    mp: AxisGroup
    embedding: AxisGroup
    world: AxisGroup
    tp_cp: AxisGroup | None = None  # the ranks sharing one sequence (MoE balancing counts its tokens)
    # the expert grid (``Topology``'s expert axes; without experts the dense groups of the same ranks)
    etp: AxisGroup | None = None
    ep: AxisGroup | None = None
    etp_ep: AxisGroup | None = None
    etp_ep_pp: AxisGroup | None = None
    edp: AxisGroup | None = None
    # per partition size K (``create_process_groups(dp_partitions=...)``): the run of K data-parallel ranks
    # this rank is in ("dp_partK") and the dp ranks at its place in every other run ("dp_replicaK")
    dp_partition_groups: dict[int, tuple[AxisGroup, AxisGroup]] = field(default_factory=dict)

    def dp_partition(self, size: int) -> tuple[AxisGroup, AxisGroup]:
        """(partition, replica) groups of ``size`` (``Topology.dp_partitions``); the whole dp x cp group and
        a group of one for ``size`` = dp x cp."""
        if size == self.dp_cp.size:
            return self.dp_cp, AxisGroup("dp_replica", (self.rank,), None, self.stats)
        if size not in self.dp_partition_groups:
            raise KeyError(f"no data-parallel partitions of {size} ranks were created: pass dp_partitions="
                           f"({size},) to create_process_groups")
        return self.dp_partition_groups[size]

    @property
    def pp_rank(self) -> int:
        return self.topology.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.topology.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.topology.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.topology.cp_rank(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topology.last_stage


def create_process_groups(topology: Topology, timeout_s: float | None = None,
                          dp_partitions: tuple[int, ...] = ()) -> ParallelGroups:
    """Create all groups of ``topology`` and return the ones this rank belongs to.

    Raises ValueError (before any group is created, so nothing hangs) when the launcher's world size
    differs from the topology's. Single-rank groups get no torch group: they never communicate.
    ``timeout_s`` bounds every collective of the groups (torch does not pass the world group's timeout
    on: without it a silent peer stalls a group's collective for torch's default of 30 minutes).
    ``dp_partitions``: sizes K for which the data-parallel groups are also cut into runs of K ranks and
    replica groups across the runs (``ParallelGroups.dp_partition``).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "parallel.process_groups.init_distributed() first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != topology.world_size:
        raise ValueError(f"the launcher started {world_size} processes but the layout is for "
                         f"{topology.world_size} "
                         f"(pp {topology.pp} x dp {topology.dp} x cp {topology.cp} x tp {topology.tp}): "
                         "launch "
                         f"{topology.world_size} "
                         f"processes or change the parallel sizes")
    topology.warn_if_tp_spans_nodes()
    stats = CommStats(topology.gpus_per_node)  # nodes of --gpus-per-node ranks, else the launcher's
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    mine: dict[str, AxisGroup] = {}
    # an expert group whose ranks a dense group already has shares its torch group
    handles: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for axis in AXES + EXPERT_AXES:
        if axis == "dp-cp" and topology.cp == 1:  # the data-parallel group itself: no second torch group
            mine[axis] = mine["dp"]
            continue
        for ranks in map(tuple, topology.groups(axis)):
            if (axis in EXPERT_AXES or axis == "tp-cp") and ranks in handles:
                handle = handles[ranks]
            else:
                handle = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                handles.setdefault(ranks, handle)
            if rank in ranks:
                mine[axis] = AxisGroup(axis, ranks, handle, stats)
        if axis == "embedding" and axis not in mine:  # a middle pipeline stage holds no embedding
            mine[axis] = AxisGroup(axis, (rank,), None, stats)
    if torch.cuda.is_available() and mine["pp"].size > 1:
        # NCCL needs every rank of a group in its first operation, and p2p on a fresh group would not be:
        # one collective on a GPU tensor creates the pipeline group's NCCL communicator (a barrier would
        # run on the gloo half of the "cpu:gloo,cuda:nccl" backend and create nothing)
        comm.all_reduce(torch.zeros(1, device=default_device()), mine["pp"])
    partitions = {}
    for size in sorted(set(dp_partitions) - {topology.dp_cp}):
        for axis, groups in zip((f"dp_part{size}", f"dp_replica{size}"), topology.dp_partitions(size)):
            for ranks in groups:
                handle = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    partitions.setdefault(size, []).append(AxisGroup(axis, tuple(ranks), handle, stats))
    world = AxisGroup("world", tuple(range(world_size)), dist.group.WORLD if world_size > 1 else None, stats)
    return ParallelGroups(topology=topology, rank=rank, stats=stats, world=world,
                          dp_partition_groups={size: tuple(pair) for size, pair in partitions.items()},
                          **{axis.replace("-", "_"): group for axis, group in mine.items()})
