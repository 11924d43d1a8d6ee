"""What this process sent: bytes and calls per collective operation and group axis, and the bytes of
those that crossed a node boundary. Counted by ``parallel.comm`` (its docstring gives the ring model);
read once per iteration by the trainer's metrics.
"""

from __future__ import annotations

import os
from collections import defaultdict

OPERATIONS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "p2p")


def node_size_of(given: int | None = None) -> int | None:
    """Ranks per node: ``given`` (e.g. --gpus-per-node), else the launcher's LOCAL_WORLD_SIZE, else None
    (unknown: one node)."""
    if given is None and os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return given


class CommStats:
    """Bytes sent and calls made by this process, per (operation, axis), and the bytes of those that
    crossed a node boundary.

    Owns plain counters and the node size (``node_size`` consecutive global ranks per node: the
    launcher's LOCAL_WORLD_SIZE unless given, e.g. from --gpus-per-node; None when neither is known:
    one node, nothing crosses). It never communicates. Read with ``bytes_by_operation()`` /
    ``inter_node_bytes_by_operation()`` / ``bytes_by_axis()`` / ``snapshot()`` and clear with
    ``reset()`` (the trainer does both once per iteration); ``issued`` and ``last_call`` outlive a reset.
    """

    def __init__(self, node_size: int | None = None) -> None:
        size = node_size_of(node_size)
        if size is not None and size < 1:
            raise ValueError(f"node size {size}: a node holds at least one rank")
        self.node_size = size
        self._bytes: dict[tuple[str, str], float] = defaultdict(float)
        self._inter_node: dict[tuple[str, str], float] = defaultdict(float)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self.issued = 0  # calls since the process began (never reset): a hang watchdog's sign of progress
        self.last_call: tuple[str, str] | None = None  # (operation, axis) of the newest call

    def node(self, rank: int) -> int:
        """The node of global ``rank`` (0 for every rank when the node size is unknown)."""
        return 0 if self.node_size is None else rank // self.node_size

    def add(self, operation: str, axis: str, nbytes: float, inter_node: float = 0.0) -> None:
        """Count one call sending ``nbytes``, ``inter_node`` of them to another node."""
        self._bytes[(operation, axis)] += nbytes
        self._calls[(operation, axis)] += 1
        self.issued += 1
        self.last_call = (operation, axis)
        if inter_node:
            self._inter_node[(operation, axis)] += inter_node

    def bytes_by_operation(self) -> dict[str, int]:
        """Bytes sent per operation (every operation listed, 0 when unused)."""
        return self._by_operation(self._bytes)

    def inter_node_bytes_by_operation(self) -> dict[str, int]:
        """Bytes sent to another node per operation (every operation listed, 0 when unused)."""
        return self._by_operation(self._inter_node)

    @staticmethod
    def _by_operation(counts: dict[tuple[str, str], float]) -> dict[str, int]:
        totals = dict.fromkeys(OPERATIONS, 0.0)
        for (operation, _), nbytes in counts.items():
            totals[operation] += nbytes
        return {op: int(round(v)) for op, v in totals.items()}

    def bytes_by_axis(self) -> dict[str, int]:
        totals: dict[str, float] = defaultdict(float)
        for (_, axis), nbytes in self._bytes.items():
            totals[axis] += nbytes
        return {axis: int(round(v)) for axis, v in totals.items()}

    def total_bytes(self) -> int:
        return int(round(sum(self._bytes.values())))

    def snapshot(self) -> dict:
        """Bytes and calls keyed by "operation/axis", plus per-operation totals."""
        return {
            "by_operation": self.bytes_by_operation(),
            "inter_node_by_operation": self.inter_node_bytes_by_operation(),
            "by_axis": self.bytes_by_axis(),
            "bytes": {f"{op}/{axis}": int(round(v)) for (op, axis), v in self._bytes.items()},
            "calls": {f"{op}/{axis}": n for (op, axis), n in self._calls.items()},
        }

    def reset(self) -> None:
        self._bytes.clear()
        self._inter_node.clear()
        self._calls.clear()
