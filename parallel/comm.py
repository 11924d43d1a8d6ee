"""Counted collectives: the only module that calls torch.distributed communication.

Every call adds the bytes this rank sends to a ``CommStats`` object shared by all groups of the process,
keyed by operation and by axis (n = group size, S = tensor bytes):

    all_reduce      2 (n-1)/n S        reduce_scatter  (n-1)/n S_in
    all_gather      (n-1)/n S_out      all_to_all      (n-1)/n S_in (uneven: the rows sent to others)
    p2p             S per send         broadcast       S per rank it passes S on to (gloo: a
                                                       binomial tree from the source; NCCL: a chain)

Bytes that cross a node boundary are counted again, per operation, by the pattern the backend sends
them in (to whom: ``AxisGroup.count``). Around a ring (all-reduce, NCCL's all-gather and
reduce-scatter) a rank sends everything to the next rank of its group (group order), so all of its
bytes cross when that rank sits on another node and none otherwise. Directly (an all-to-all, and on
gloo the all-gather and the sum reduce-scatter) a rank sends an equal part to every other rank, and
each part crosses when its rank does; a broadcast's copies and a point-to-point send cross when their
destination does. Nodes hold consecutive global ranks, ``CommStats.node_size`` of them. What gloo
really puts on a link beside these counts: ``launch.bench.wire_bytes``.

A group of one rank sends nothing and makes no call. ``async_op=True`` returns a handle with
``wait()`` so callers can overlap communication with compute: every collective here is posted whole
when it starts, to torch's asynchronous collectives or point-to-point operations, which the backend
progresses in the background (gloo on its worker and transport threads, NCCL on its stream), so
handles may be waited in any order.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.comm_stats import OPERATIONS, CommStats  # noqa: F401  (the counters every caller passes around)

# torch >= 2.13 renamed the flat-tensor collectives; the old names still work on older releases
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class AxisGroup:
    """One process group of one axis, as seen from this rank.

    Owns the torch group handle (None for a single-rank group, which needs no communication), its
    global ranks in group order, and a reference to the process-wide ``CommStats``. It never
    communicates by itself: pass it to the functions of this module.
    """

    axis: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    stats: CommStats = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        return self.ranks.index(dist.get_rank()) if self.size > 1 else 0

    def crosses_node(self, peer: int) -> bool:
        """Whether global rank ``peer`` is on another node than this process."""
        return self.stats.node(peer) != self.stats.node(dist.get_rank())

    def count(self, operation: str, sends: list[tuple[int, float]]) -> None:
        """Count a collective of this group in which this rank sends (global peer rank, bytes) ``sends``."""
        self.stats.add(operation, self.axis, sum(nbytes for _, nbytes in sends),
                       sum(nbytes for peer, nbytes in sends if self.crosses_node(peer)))

    def around_ring(self, nbytes: float) -> list[tuple[int, float]]:
        """``nbytes`` to the next rank of the group."""
        return [(self.ranks[(self.rank + 1) % self.size], nbytes)]

    def directly(self, nbytes: float) -> list[tuple[int, float]]:
        """``nbytes`` in equal parts to every other rank of the group."""
        me = self.ranks[self.rank]
        return [(peer, nbytes / (self.size - 1)) for peer in self.ranks if peer != me]


def as_axis_group(group, axis: str = "dp", stats: CommStats | None = None) -> AxisGroup:
    """``group`` as this module's group: an ``AxisGroup`` as it is; a torch ``ProcessGroup``; a 1-D
    ``DeviceMesh``; or None, the default (world) group."""
    if isinstance(group, AxisGroup):
        return group
    if group is not None and hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"a {group.ndim}-D DeviceMesh names no single group: pass mesh[\"{axis}\"]")
        group = group.get_group()
    if group is None and not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(or parallel.process_groups.init_distributed) first, or pass a group")
    group = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    return AxisGroup(axis, ranks, group if len(ranks) > 1 else None, stats or CommStats())


@dataclass(frozen=True)
class DetachedGroup:
    """A group of ``size`` ranks seen from its first rank, with no processes behind it: enough to build
    one rank's part of a model on the meta device and count its parameters (``models.counting``).

    Owns its size only. It never communicates: a collective on it raises.
    """

    axis: str
    size: int
    stats: CommStats = field(default_factory=CommStats, repr=False)
    rank = 0

    @property
    def group(self) -> dist.ProcessGroup:
        raise RuntimeError(f"a detached {self.axis} group of {self.size} has no processes "
                           "to communicate with")


class Completed:
    """Handle of an operation that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def advance(self) -> None:
        """Nothing in flight to move on (as a staged reduction's handle)."""


def compile_boundary(fn):
    """``fn`` run eagerly under ``torch.compile``: a compiled region ends before the call and the next one
    begins after it. For what communicates (a collective and the autograd function around it) or keeps
    Python state (checkpoint slots, random streams): a compiled graph never traces communication, and
    every graph break of a compiled layer is one of these (``models.compile`` counts them)."""
    return torch.compiler.disable(fn, recursive=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view (gloo wants output = n x input shape exactly; flat views always qualify)."""
    if not tensor.is_contiguous():
        raise ValueError("collectives need contiguous tensors: call .contiguous() first")
    return tensor.view(-1)


def _ring_fraction(group: AxisGroup) -> float:
    return (group.size - 1) / group.size


def all_reduce(tensor: torch.Tensor, group: AxisGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce (SUM by default; gloo has no AVG: divide afterwards)."""
    if group.size == 1:
        return Completed() if async_op else None
    group.count("all_reduce", group.around_ring(2 * _ring_fraction(group) * _nbytes(tensor)))
    return dist.all_reduce(tensor, op=op, group=group.group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                          op=dist.ReduceOp.SUM, async_op: bool = False):
    """Reduce ``input`` (n equal chunks along dim 0) and leave chunk ``group.rank`` in ``output``.

    On gloo, whose reduce-scatter sends as much as a full all-reduce, a SUM is an all-to-all
    (``_SummedExchange``) that sends the ideal (n-1)/n of the input. ``output`` may be a view of
    ``input``'s own chunk (in place); it is written by ``wait()``, not before.
    """
    if input.numel() != output.numel() * group.size:
        raise ValueError(f"reduce_scatter over {group.axis} (size {group.size}): input has {input.numel()} "
                         f"elements, output {output.numel()}; input must be exactly size x output")
    if group.size == 1:
        output.copy_(input.view_as(output))
        return Completed() if async_op else None
    exchanged = op == dist.ReduceOp.SUM and dist.get_backend(group.group) == "gloo"
    sent = _ring_fraction(group) * _nbytes(input)
    group.count("reduce_scatter", group.directly(sent) if exchanged else group.around_ring(sent))
    if exchanged:
        exchange = _SummedExchange(_flat(output), _flat(input), group)
        return exchange if async_op else exchange.wait()
    return _reduce_scatter_flat(_flat(output), _flat(input), op=op, group=group.group, async_op=async_op)


class _SummedExchange:
    """A sum reduce-scatter as torch's asynchronous all-to-all: chunk j of every rank's input goes to rank
    j (the backend progresses it in the background, like any collective it runs, so handles may be
    waited in any order), and ``wait`` sums the n copies of this rank's chunk in rank order, in fp32 (at
    least), into ``output``. Holds one input-sized receive buffer while in flight."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: AxisGroup):
        self.output, self.size = output, group.size
        self.received = torch.empty_like(input)
        self.work = dist.all_to_all_single(self.received, input, group=group.group, async_op=True)

    def wait(self) -> None:
        if self.work is None:
            return None
        self.work.wait()
        rows = self.received.view(self.size, -1)
        if self.output.dtype in (torch.float32, torch.float64):
            total = torch.add(rows[0], rows[1], out=self.output)
        else:
            total = torch.add(rows[0].float(), rows[1])
        for row in rows[2:]:
            total.add_(row)
        if total is not self.output:
            self.output.copy_(total)
        self.work = self.received = None
        return None

    def is_completed(self) -> bool:
        return self.work is None


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                           async_op: bool = False):
    """Concatenate every rank's ``input`` along dim 0 into ``output``, in group order; ``input`` may be
    ``output``'s own chunk (in place).

    On gloo, whose all-gather passes every chunk around its ring one step after another and stages the
    output in a temporary of its own, it is ``_DirectGather``: every chunk straight from its owner into
    its place (measured at 16 MiB: 0.6x gloo's time at dp 4 and 8, 0.8x at dp 2; gloo-wire-costs note).
    """
    if output.numel() != input.numel() * group.size:
        raise ValueError(f"all_gather over {group.axis} (size {group.size}): output has {output.numel()} "
                         f"elements, input {input.numel()}; output must be exactly size x input")
    if group.size == 1:
        output.copy_(input.view_as(output))
        return Completed() if async_op else None
    sent = _ring_fraction(group) * _nbytes(output)
    if dist.get_backend(group.group) == "gloo":
        group.count("all_gather", group.directly(sent))
        gather = _DirectGather(_flat(output), _flat(input), group)
        return gather if async_op else gather.wait()
    group.count("all_gather", group.around_ring(sent))
    return _all_gather_flat(_flat(output), _flat(input), group=group.group, async_op=async_op)


class _DirectGather:
    """An all-gather as one batch of point-to-point operations posted at once: this rank's chunk to every
    other rank, every other rank's chunk received straight into its place in ``output``. The transport
    progresses them in the background, so handles may be waited in any order. Each gather takes the
    next tag of its group (the same on every rank, as every rank starts its collectives in one order),
    so gathers in flight together never take each other's chunks."""

    _tags: dict[dist.ProcessGroup, int] = {}
    FIRST_TAG = 1 << 20  # above the tags callers give their own point-to-point streams

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: AxisGroup):
        chunks = output.view(group.size, -1)
        own = chunks[group.rank]
        if input.data_ptr() != own.data_ptr():
            own.copy_(input)
        count = _DirectGather._tags.get(group.group, 0)
        _DirectGather._tags[group.group] = (count + 1) % (1 << 20)
        tag = self.FIRST_TAG + count
        ops = []
        for index, peer in enumerate(group.ranks):
            if index != group.rank:
                ops += [dist.P2POp(dist.isend, own, peer, group=group.group, tag=tag),
                        dist.P2POp(dist.irecv, chunks[index], peer, group=group.group, tag=tag)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        return None

    def is_completed(self) -> bool:
        return not self.works


def all_gather_object(value, group: AxisGroup, device: torch.device) -> list:
    """Every rank's picklable ``value``, in group order (lengths first, then the padded bytes; on
    ``device``, which NCCL needs to be an accelerator). For small start-up messages, not tensors."""
    if group.size == 1:
        return [value]
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    lengths = torch.empty(group.size, dtype=torch.int64, device=device)
    all_gather_into_tensor(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    everyone = torch.empty(longest * group.size, dtype=torch.uint8, device=device)
    all_gather_into_tensor(everyone, padded, group)
    rows = everyone.view(group.size, longest).cpu()
    return [pickle.loads(rows[i, :int(lengths[i])].numpy().tobytes()) for i in range(group.size)]


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: AxisGroup, async_op: bool = False):
    """Part j of ``input`` (n equal parts along dim 0) goes to the group's rank j; part i of ``output``
    comes from rank i (both contiguous, of equal sizes, not overlapping)."""
    if input.numel() != output.numel() or input.numel() % group.size:
        raise ValueError(f"all_to_all over {group.axis} (size {group.size}): input has {input.numel()} "
                         "elements, "
                         f"output {output.numel()}; both must be equal and divisible by the size")
    if group.size == 1:
        output.copy_(input)
        return Completed() if async_op else None
    group.count("all_to_all", group.directly(_ring_fraction(group) * _nbytes(input)))
    return dist.all_to_all_single(_flat(output), _flat(input), group=group.group, async_op=async_op)


def all_to_all_uneven(input: torch.Tensor, input_splits: list[int], output_splits: list[int],
                      group: AxisGroup) -> torch.Tensor:
    """Rows ``input_splits[j]`` of ``input`` (consecutive along dim 0) go to the group's rank j; returns the
    rows received, ``output_splits[i]`` from rank i, in group order. Counted exactly: the bytes of the rows
    sent to each other rank (a rank's rows to itself stay in memory)."""
    if len(input_splits) != group.size or len(output_splits) != group.size \
            or sum(input_splits) != input.shape[0]:
        raise ValueError(f"all_to_all over {group.axis} (size {group.size}): splits {input_splits} / "
                         f"{output_splits} do not match {input.shape[0]} rows and the group")
    output = input.new_empty((sum(output_splits), *input.shape[1:]))
    if group.size == 1:
        return output.copy_(input)
    per_row = math.prod(input.shape[1:])
    group.count("all_to_all", [(peer, rows * per_row * input.element_size())
                               for index, (peer, rows) in enumerate(zip(group.ranks, input_splits))
                               if index != group.rank])
    dist.all_to_all_single(_flat(output), _flat(input.contiguous()), [n * per_row for n in output_splits],
                           [n * per_row for n in input_splits], group=group.group)
    return output


def broadcast(tensor: torch.Tensor, src: int, group: AxisGroup, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src`` to every rank of the group."""
    if src not in group.ranks:
        raise ValueError(f"broadcast source rank {src} is not in the {group.axis} group {list(group.ranks)}")
    if group.size == 1:
        return Completed() if async_op else None
    group.count("broadcast", _broadcast_sends(group, group.ranks.index(src), _nbytes(tensor)))
    return dist.broadcast(tensor, src=src, group=group.group, async_op=async_op)


def _broadcast_sends(group: AxisGroup, source: int, nbytes: int) -> list[tuple[int, float]]:
    """Whom this rank passes a broadcast from group index ``source`` on: on gloo a binomial tree (the
    rank ``d`` places after the source sends to ``d + 2^k`` for every ``2^k > d`` inside the group), on
    NCCL a chain in group order (to the next rank unless that is the source)."""
    n, d = group.size, (group.rank - source) % group.size
    if dist.get_backend(group.group) == "gloo":
        children, step = [], 1
        while step < n:
            if step > d and d + step < n:
                children.append(group.ranks[(source + d + step) % n])
            step *= 2
        return [(child, nbytes) for child in children]
    return [] if d == n - 1 else [(group.ranks[(group.rank + 1) % n], nbytes)]


def send(tensor: torch.Tensor, dst: int, group: AxisGroup) -> None:
    """Blocking send to global rank ``dst``."""
    group.count("p2p", [(dst, _nbytes(tensor))])
    dist.send(tensor, dst=dst, group=group.group)


def recv(tensor: torch.Tensor, src: int, group: AxisGroup) -> None:
    """Blocking receive from global rank ``src`` into ``tensor`` (its shape must be known in advance)."""
    dist.recv(tensor, src=src, group=group.group)


def batch_isend_irecv(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
                      group: AxisGroup) -> list:
    """Post all sends (tensor, dst, tag) and receives (tensor, src, tag) as one batch; return handles.

    Posting both directions together is what lets two neighbours exchange without deadlock. The tag
    separates independent streams between the same two ranks (gloo matches on it; NCCL matches in
    posting order, so both sides must post a pair's operations in the same order).
    """
    ops = [dist.P2POp(dist.isend, t, peer, group=group.group, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group.group, tag=tag) for t, peer, tag in recvs]
    for tensor, peer, _ in sends:
        group.count("p2p", [(peer, _nbytes(tensor))])
    return dist.batch_isend_irecv(ops) if ops else []


def barrier(group: AxisGroup) -> None:
    """Wait until every rank of the group arrives (sends no counted payload)."""
    if group.size > 1:
        dist.barrier(group=group.group)
