"""The grid of processes: pipeline x data x context x tensor, as pure rank algebra.

Rank order (megatron-core's default "tp-cp-ep-dp-pp" with ep = 1):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so tensor-parallel peers are neighbours (same node, fastest link), then context-parallel peers (they
exchange keys and values every layer), then data-parallel peers, then pipeline stages. The whole grid
is ``arange(world).reshape(pp, dp, cp, tp)``; every group is a line or a plane of that array. Nothing
here touches torch.distributed (see ``parallel.process_groups``).

Axes (named as megatron-core's RankGenerator names them):
    tp         ranks holding slices of the same layers (same pp, dp, cp)
    cp         ranks holding pieces of the same sequences, replicas of the same model slice (same pp, dp, tp)
    dp         ranks holding replicas (or ZeRO shards) of the same model slice, reading other samples
               (same pp, cp, tp)
    dp-cp      data x context: every rank of one model slice (same pp, tp); gradients are reduced and
               ZeRO shards its states over this group, as Megatron's distributed optimizer does
    pp         the pipeline stages of one model replica (same dp, cp, tp)
    mp         model parallel: all tp x pp ranks of one replica (same dp, cp)
    embedding  the first and last pipeline stage of each (dp, cp, tp) position (tied embedding)
    tp-cp      tensor x context: the ranks that hold parts of the same sequences

The expert layers of a mixture of experts lay the same world out again, as megatron-core's expert
rank generator does ("tp-ep-dp-pp" without cp, pipeline stages shared with the dense grid):

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank)),  edp = world / (etp * ep * pp)

    etp        expert tensor parallel: ranks holding slices of the same experts (default: tp)
    ep         expert model parallel: ranks holding different experts of a layer (the all-to-all group)
    etp-ep     both: the ranks among which one layer's experts are spread
    etp-ep-pp  both, over the pipeline stages
    edp        expert data parallel: ranks holding the same expert slices (ZeRO shards experts over it)

Run ``python -m parallel.topology --world-size 16 --tp 2 --pp 2 --cp 2 --gpus-per-node 8`` to print a grid
(``--ep`` and ``--etp`` add the expert groups).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import warnings
from dataclasses import dataclass

AXES = ("tp", "cp", "dp", "dp-cp", "pp", "mp", "embedding", "tp-cp")
EXPERT_AXES = ("etp", "ep", "etp-ep", "etp-ep-pp", "edp")
# the dimensions of its grid along which each axis's groups run (the embedding's: see ``_enumerate``)
VARYING = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp-cp": ("cp", "dp"), "tp-cp": ("tp", "cp"),
           "pp": ("pp",),
           "mp": ("tp", "pp"), "etp": ("etp",), "ep": ("ep",), "etp-ep": ("etp", "ep"),
           "etp-ep-pp": ("etp", "ep", "pp"), "edp": ("edp",)}


@dataclass(frozen=True)
class Topology:
    """The layout of ``world_size`` ranks as a pp x dp x cp x tp grid, and for expert layers as a pp x edp
    x ep x etp grid (``ep``, ``etp``; etp None: tp).

    Owns only integers: it never creates process groups and never reads the environment, so any
    layout (also one far larger than this machine) can be inspected and tested anywhere.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    gpus_per_node: int | None = None
    ep: int = 1
    etp: int | None = None
    pipeline_v: bool = False  # each pp rank holds two model chunks in a V (zbv): the loss is on pp rank 0

    def __post_init__(self) -> None:
        for name, value in (("world size", self.world_size), ("--tensor-model-parallel-size", self.tp),
                            ("--pipeline-model-parallel-size", self.pp),
                            ("--context-parallel-size", self.cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tp > self.world_size:
            raise ValueError(f"--tensor-model-parallel-size {self.tp} is larger than the world size "
                             f"{self.world_size}: use at most {self.world_size} or launch more processes")
        if self.pp > self.world_size:
            raise ValueError(f"--pipeline-model-parallel-size {self.pp} is larger than the world size "
                             f"{self.world_size}: use at most {self.world_size} or launch more processes")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            context = f" x --context-parallel-size {self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp}"
                f"{context} x --pipeline-model-parallel-size {self.pp} = {model}: launch a multiple of "
                f"{model} processes or change tp/{'cp/' if self.cp > 1 else ''}pp")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        for name, value in (("--expert-model-parallel-size", self.ep),
                            ("--expert-tensor-parallel-size", self.expert_tp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        experts = self.expert_tp * self.ep * self.pp
        if self.world_size % experts:
            raise ValueError(
                f"world size {self.world_size} is not divisible by {self.expert_tp_flag} x "
                f"--expert-model-parallel-size {self.ep} x "
                f"--pipeline-model-parallel-size {self.pp} = {experts}: the expert layers lay the same ranks "
                "out as etp x ep x expert dp x pp")

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (--expert-tensor-parallel-size; default the dense tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_tp_flag(self) -> str:
        """The expert tp size as an error names it: the flag, and where its value came from when not given."""
        return f"--expert-tensor-parallel-size {self.expert_tp}" + (
            "" if self.etp is not None else
            " (not given: it defaults to --tensor-model-parallel-size; give it, e.g. 1)")

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def last_stage(self) -> int:
        """The pipeline rank that holds the last virtual stage (the output layer and the loss)."""
        return 0 if self.pipeline_v else self.pp - 1

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (tp * cp * pp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def dp_cp(self) -> int:
        """The size of a data x context group: the ranks gradients are reduced and ZeRO shards over."""
        return self.dp * self.cp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (its cp rank: ``cp_rank``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def cp_rank(self, rank: int) -> int:
        """The context-parallel coordinate of a global rank: which pieces of each sequence it holds."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return (rank // self.tp) % self.cp

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """Global rank at grid position (pp, dp, cp, tp)."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp),
                                  ("cp", cp, self.cp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside 0..{size - 1}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` as a list of ranks, in a fixed order shared by all ranks."""
        return [list(ranks) for ranks in _groups(self, axis)]

    def group_tuples(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """``groups``, as one object kept per topology and axis (not copied: for readers that only count)."""
        return _groups(self, axis)

    def _enumerate(self, axis: str) -> list[list[int]]:
        if axis == "embedding":
            return [sorted({ranks[0], ranks[self.last_stage]}) for ranks in self._enumerate("pp")]
        if axis in EXPERT_AXES:
            dims = (("etp", self.expert_tp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp))
        elif axis in AXES:
            dims = (("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp))
        else:
            raise ValueError(f"unknown axis {axis!r}: choose one of {', '.join(AXES + EXPERT_AXES)}")
        return _lines(dims, VARYING[axis])

    def dp_partitions(self, size: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every data x context group (the data-parallel group when cp = 1) cut into runs of ``size``
        consecutive ranks (ZeRO++'s hpZ partitions, HSDP's shard groups, the ranks of a node), and the
        groups across the runs: the ranks at the same place in each run (the replicas). Both in a fixed
        order shared by all ranks."""
        if size < 1 or self.dp_cp % size:
            raise ValueError(f"a partition of {size} data-parallel ranks does not divide "
                             f"{'dp x cp' if self.cp > 1 else 'dp'} {self.dp_cp}")
        partitions, replicas = [], []
        for ranks in self.groups("dp-cp"):
            runs = [ranks[start:start + size] for start in range(0, len(ranks), size)]
            partitions += runs
            replicas += [list(across) for across in zip(*runs)]
        return partitions, replicas

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - a frozen value: the planner asks it of every layout
    def dp_ranks_per_node(self, node_size: int | None) -> int:
        """The most consecutive ranks of a data x context group that always share a node of ``node_size``
        ranks (a divisor of dp x cp; all of them when the nodes are unknown or one node holds every
        group)."""
        size = self.dp_cp
        if node_size is None:
            return size
        for count in range(size, 0, -1):
            if size % count == 0 and all(len({rank // node_size
                                              for rank in ranks[start:start + count]}) == 1
                                         for ranks in self.groups("dp-cp")
                                         for start in range(0, size, count)):
                return count
        return 1

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of the ``axis`` group that contains ``rank``."""
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is in no {axis} group")

    def node(self, rank: int) -> int | None:
        """Index of the node hosting ``rank`` (ranks fill nodes in order), or None if unknown."""
        return None if self.gpus_per_node is None else rank // self.gpus_per_node

    def tp_groups_spanning_nodes(self) -> list[list[int]]:
        """Tensor-parallel groups whose ranks sit on more than one node (slow links for every layer)."""
        if self.gpus_per_node is None:
            return []
        return [ranks for ranks in self.groups("tp") if len({self.node(r) for r in ranks}) > 1]

    def warn_if_tp_spans_nodes(self) -> None:
        """Warn when a tensor-parallel group crosses nodes: every layer would all-reduce over the network."""
        spanning = self.tp_groups_spanning_nodes()
        if spanning:
            warnings.warn(f"{len(spanning)} tensor-parallel group(s) span nodes (e.g. ranks "
                          f"{spanning[0]} with "
                          f"--gpus-per-node {self.gpus_per_node}): choose --tensor-model-parallel-size "
                          "dividing "
                          f"{self.gpus_per_node}", stacklevel=2)

    def describe(self) -> str:
        """A human-readable table of every group, with node placement when known."""
        def fmt(ranks: list[int]) -> str:
            if self.gpus_per_node is None:
                return str(ranks)
            return "[" + ", ".join(f"{r}@n{self.node(r)}" for r in ranks) + "]"

        context = f" x cp {self.cp}" if self.cp > 1 else ""
        lines = [f"world {self.world_size} = pp {self.pp} x dp {self.dp}{context} x tp {self.tp}"
                 + (f", {self.gpus_per_node} per node" if self.gpus_per_node else "")]
        experts = self.ep > 1 or self.expert_tp != self.tp
        if experts:
            lines[0] += (f"; experts: pp {self.pp} x edp {self.edp} x ep {self.ep} x etp {self.expert_tp}")
        for axis in AXES + (EXPERT_AXES if experts else ()):
            lines.append(f"{axis:>9}: " + " ".join(fmt(g) for g in self.groups(axis)))
        lines.append("    ranks: " + " ".join(
            f"{r}=(pp{p},dp{d}{f',cp{self.cp_rank(r)}' if self.cp > 1 else ''},tp{t})"
            for r in range(self.world_size) for p, d, t in [self.coords(r)]))
        spanning = self.tp_groups_spanning_nodes()
        if spanning:
            lines.append(f"  warning: {len(spanning)} tensor-parallel group(s) span nodes")
        return "\n".join(lines)


def _lines(dims: tuple[tuple[str, int], ...], varying: tuple[str, ...]) -> list[list[int]]:
    """The groups of a grid whose dimensions ``dims`` (name, size) are listed fastest first (rank = i0 + n0 x
    (i1 + n1 x (...))) in which the ``varying`` dimensions change and the others stay: a group for each
    setting of the others, in a group each setting of the varying ones, the slowest dimension outermost in
    both (megatron-core's order)."""
    strides, stride = {}, 1
    for name, size in dims:
        strides[name], stride = stride, stride * size

    def offsets(names) -> list[int]:
        chosen = [(strides[name], size) for name, size in reversed(dims) if name in names]
        return [sum(index * step for index, (step, _) in zip(indices, chosen))
                for indices in itertools.product(*(range(size) for _, size in chosen))]

    others = {name for name, _ in dims} - set(varying)
    return [[base + offset for offset in offsets(varying)] for base in offsets(others)]


@functools.lru_cache(maxsize=256)
def _groups(topology: Topology, axis: str) -> tuple[tuple[int, ...], ...]:
    """``Topology.groups``, kept per topology and axis: the planner prices thousands of layouts on a few
    grids of up to thousands of ranks."""
    return tuple(tuple(ranks) for ranks in topology._enumerate(axis))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m parallel.topology", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    parser.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1)
    parser.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        topology = Topology(args.world_size, args.tp, args.pp, args.cp, args.gpus_per_node, args.ep, args.etp)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    print(topology.describe())


if __name__ == "__main__":
    main()
