"""The process groups a ZeRO optimizer talks over, cut from a run's data x context group (parameters are
replicated over context parallelism as over data parallelism, so both reduce gradients and shard states)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.comm import AxisGroup, as_axis_group
from parallel.comm_stats import node_size_of
from parallel.process_groups import ParallelGroups
from parallel.topology import Topology
from parallel.zero.grad_sync import ModelParallelGroups
from parallel.zero.options import ZeroOptions


@dataclass(frozen=True)
class ZeroGroups:
    """The groups of one ZeRO optimizer: ``shard`` (the ranks that split its states: the data-parallel
    group, or one MiCS / HSDP shard group), ``replicas`` (the ranks holding this rank's shard in the
    other shard groups), ``secondary_partition`` (hpZ's K ranks within a node), ``gradient_levels``
    (qgZ's all-to-all levels: [node, across nodes], or [shard]), ``model_parallel`` and ``average_over``:
    how many replicas of the loss a summed gradient is the sum of (default: the data-parallel size; the
    expert optimizer's gradients, summed over the expert dp group, average the whole data x context
    group's losses, as Megatron scales them).

    It never creates a group: ``create_process_groups`` does, for the sizes ``dp_partitions`` names.
    """

    shard: AxisGroup
    replicas: AxisGroup | None = None
    secondary_partition: AxisGroup | None = None
    gradient_levels: tuple[AxisGroup, ...] | None = None
    model_parallel: ModelParallelGroups = field(default_factory=ModelParallelGroups)
    average_over: int | None = None

    @classmethod
    def of(cls, group, options: ZeroOptions) -> ZeroGroups:
        """``group`` as ZeroGroups: itself, or a plain group (a ``ProcessGroup``, 1-D ``DeviceMesh``,
        ``AxisGroup``, or None for the world) that every state is sharded over, and that qgZ's all-to-all
        spans in one level."""
        if isinstance(group, ZeroGroups):
            return group
        shard = as_axis_group(group)
        return cls(shard, gradient_levels=(shard,) if options.quantized_gradients else None)

    @classmethod
    def from_parallel_groups(cls, groups: ParallelGroups, options: ZeroOptions) -> ZeroGroups:
        """The groups ``options`` asks for, out of a run's groups (created with ``dp_partitions``)."""
        shard, replicas = groups.dp_partition(options.shard_size or groups.dp_cp.size)
        hpz, per_node = options.hpz_partition_size, _gradient_node_size(groups.topology)
        levels = None
        if options.quantized_gradients:
            levels = groups.dp_partition(per_node) if 1 < per_node < groups.dp_cp.size else (groups.dp_cp,)
        return cls(shard, replicas if replicas.size > 1 else None,
                   groups.dp_partition(hpz)[0] if hpz > 1 else None, tuple(levels) if levels else None,
                   ModelParallelGroups(tp=groups.tp, model_parallel=groups.mp, embedding=groups.embedding))

    @classmethod
    def for_experts(cls, groups: ParallelGroups) -> ZeroGroups:
        """The expert parameters' groups: sharded over the expert data-parallel group, their norm summed
        over etp x ep x pp (replicas over etp counted once), averaged over data x context."""
        return cls(groups.edp, average_over=groups.dp_cp.size,
                   model_parallel=ModelParallelGroups(tp=groups.etp, model_parallel=groups.etp_ep_pp))

    @property
    def dp_size(self) -> int:
        return self.shard.size * (self.replicas.size if self.replicas is not None else 1)

    def check(self, options: ZeroOptions) -> None:
        """Raise ValueError when these groups are not the ones ``options`` describes."""
        options.check(self.dp_size)
        secondary = self.secondary_partition.size if self.secondary_partition is not None else 1
        if secondary != options.hpz_partition_size:
            raise ValueError(f"hpz_partition_size {options.hpz_partition_size} needs a secondary partition "
                             "of as many "
                             f"ranks (ZeroGroups.secondary_partition holds {secondary}): build the "
                             "groups with "
                             "ZeroGroups.from_parallel_groups")
        if (self.gradient_levels is not None) != options.quantized_gradients:
            raise ValueError("ZeroGroups.gradient_levels are given exactly when quantized_gradients is set")
        if self.replicas is not None and options.shard_size != self.shard.size:
            raise ValueError(f"shard groups of {self.shard.size} with replicas need "
                             f"shard_size={self.shard.size}")


def dp_partitions(topology: Topology, options: ZeroOptions) -> tuple[int, ...]:
    """The data-parallel partition sizes ``create_process_groups`` must cut for ``options``."""
    per_node = _gradient_node_size(topology)
    wanted = ((options.hpz_partition_size, options.hpz_partition_size > 1),
              (per_node, options.quantized_gradients and 1 < per_node < topology.dp_cp),
              (options.shard_size, options.shard_size is not None and options.shard_size < topology.dp_cp))
    return tuple(size for size, used in wanted if used)


def _gradient_node_size(topology: Topology) -> int:
    """qgZ's first level: the data-parallel ranks that share a node."""
    return topology.dp_ranks_per_node(node_size_of(topology.gpus_per_node))
