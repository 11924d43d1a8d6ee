"""The owners a checkpoint saves and loads, and where each one's state goes.

The checkpointer takes ``states: dict[str, Stateful]``. Where a state is kept follows from its type:
a ``RunState`` (the same on every rank) goes into the manifest, a ``ZeroModelState`` (parameters,
masters and optimizer states) into the rank file and is re-cut for another layout, any other
``Stateful`` (a rank's random streams) into the rank file and loads only where this rank holds the
same parameters as the one that saved it. A new checkpointed state is one more entry in the dict.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from parallel.process_groups import ParallelGroups
from parallel.topology import Topology
from parallel.zero.optimizer import ZeroOptimizer
from parallel.zero.state_readers import saved_loss_scaler
from pretrain.checkpoint import reshard


class Stateful(Protocol):
    """Anything with torch's ``state_dict`` / ``load_state_dict`` pair."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class RunState:
    """A state every rank holds alike (the data position): rank 0 saves it into the manifest, and a run of
    any layout loads it. It must hold plain JSON values, never tensors."""

    owner: Stateful

    def state_dict(self) -> dict:
        return self.owner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.owner.load_state_dict(state)


def layout_of(topology: Topology, zero_stage: int, shard_size: int | None = None) -> dict:
    """What a same-layout load must match (``shard_size``: a MiCS / HSDP shard group smaller than dp x cp;
    ``cp`` only when context parallelism is on, so the layouts of earlier checkpoints stay equal)."""
    layout = {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp, "dp": topology.dp,
              "zero_stage": zero_stage}
    if topology.cp > 1:
        layout["cp"] = topology.cp
    if shard_size is not None and shard_size != topology.dp_cp:
        layout["zero_shard_size"] = shard_size
    return layout


class ZeroModelState:
    """The model's parameters, masters, optimizer states and loss scale, as one ``ZeroOptimizer`` holds
    them on this rank, with the pieces (``reshard.describe``) that name each master range by parameter.

    Owns the rule of when a saved state loads in place (the same pieces in the same places) and when it
    is re-cut by name; it never reads or writes a file.
    """

    def __init__(self, optimizer: ZeroOptimizer, names: dict[nn.Parameter, str], groups: ParallelGroups):
        self.optimizer, self.names, self.groups = optimizer, names, groups

    def layout(self) -> dict:
        return layout_of(self.groups.topology, self.optimizer.stage, self.optimizer.dp.size)

    def in_memory(self) -> contextlib.AbstractContextManager:
        """Swapped optimizer states held in memory: ``state_dict`` and loads happen inside."""
        return self.optimizer.states_in_memory()

    def pieces(self) -> list[dict]:
        return reshard.describe(self.optimizer, self.names, self.groups.tp_rank, self.groups.topology.tp)

    def state_dict(self) -> dict:
        return {"pieces": self.pieces(), "optimizer": self.optimizer.state_dict()}

    def loads_in_place(self, saved: dict) -> bool:
        """Whether ``saved`` holds the same elements in the same masters and places as this rank."""
        return _places(self.pieces()) == _places(saved["pieces"])

    def holds_the_same(self, saved: dict) -> bool:
        """Whether ``saved`` came from a rank holding the same parameters (its rank states then apply)."""
        return {piece["name"] for piece in self.pieces()} == {piece["name"] for piece in saved["pieces"]}

    def load_state_dict(self, saved: dict) -> None:
        """Load a state saved by a rank with the same places (``loads_in_place``)."""
        self.optimizer.load_state_dict(saved["optimizer"])

    def load_recut(self, source, weights_only: bool, saved: list[dict] | None = None) -> None:
        """Fill this rank's part from ``source`` (``reshard.CheckpointPieces`` or ``WeightsFile``) by
        parameter name; ``weights_only`` leaves the optimizer fresh; ``saved``: the rank files' model states,
        whose loss scale carries over."""
        scaler = saved_loss_scaler(saved[0]["optimizer"]) if saved else None
        reshard.load(source, self.optimizer, self.names, self.groups.tp_rank, self.groups.topology.tp,
                     weights_only, scaler)


def _places(pieces: list[dict]) -> list[tuple]:
    """Where a rank's masters hold which elements of which parameter."""
    return [tuple(piece[key] for key in ("name", "master", "state", "start", "offset", "length"))
            for piece in pieces]
