"""The owners a checkpoint saves and loads, and where each one's state goes.

The checkpointer takes ``states: dict[str, Stateful]``. Where a state is kept follows from its type:
a ``RunState`` (the same on every rank) goes into the manifest, a ``ZeroModelState`` (masters and
optimizer states, as pieces each written by one rank) into the rank files and is read back by name in
any layout, any other
``Stateful`` (a rank's random streams) into the rank file and loads only where this rank holds the
same parameters as the one that saved it. A new checkpointed state is one more entry in the dict.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from parallel import comm
from parallel.process_groups import ParallelGroups, default_device
from parallel.topology import Topology
from parallel.zero.optimizer import ZeroOptimizer
from pretrain.checkpoint import reshard
from pretrain.checkpoint.geometry import SliceGeometry
from pretrain.checkpoint.saved_pieces import geometry_entry, writers


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
    """The model's masters, optimizer states and loss scale, as one ``ZeroOptimizer`` holds them on this
    rank, saved as pieces (``pretrain.checkpoint.saved_pieces``): each element by one of the ranks that
    hold it, and loaded, in this layout or any other, by parameter name (``reshard``). The parameters are
    not saved: they are the masters' values (``masters_to_parameters`` after a load).

    Owns which part of its masters this rank writes (agreed with the world once); it never reads or
    writes a file.
    """

    def __init__(self, optimizer: ZeroOptimizer, names: dict[nn.Parameter, str], groups: ParallelGroups):
        self.optimizer, self.names, self.groups = optimizer, names, groups
        self._written: list[list[tuple[int, int]]] | None = None

    def layout(self) -> dict:
        return layout_of(self.groups.topology, self.optimizer.stage, self.optimizer.dp.size)

    def in_memory(self) -> contextlib.AbstractContextManager:
        """Swapped optimizer states held in memory: ``state_dict`` and loads happen inside."""
        return self.optimizer.states_in_memory()

    def _geometry(self, piece) -> SliceGeometry:
        return reshard.held_geometry(piece.param, piece.shape, *self._places())

    def _places(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's (rank, size) in the tp and the expert tp group: where its slices sit."""
        groups = self.groups
        return (groups.tp_rank, groups.topology.tp), (groups.etp.rank, groups.etp.size)

    def held(self) -> list[str]:
        """The names of the parameters this rank holds."""
        return sorted({self.names[piece.param] for piece in self.optimizer.master_pieces()})

    def written(self) -> list[list[tuple[int, int]]]:
        """For each of this rank's master pieces, the ranges of it this rank writes (a collective over the
        world the first time: every rank's pieces decide who writes what)."""
        if self._written is None:
            mine = [((self.names[piece.param], self._geometry(piece).tp_rank), piece.start, piece.length)
                    for piece in self.optimizer.master_pieces()]
            everyone = comm.all_gather_object(mine, self.groups.world, default_device())
            self._written = writers(everyone)[self.groups.rank]
        return self._written

    def state_dict(self) -> dict:
        """This rank's pieces (views of its masters and states, not copies), the names it holds, the loss
        scale."""
        pieces = []
        for piece, ranges in zip(self.optimizer.master_pieces(), self.written()):
            geometry = geometry_entry(self._geometry(piece))
            for start, length in ranges:
                values, scalars = self.optimizer.piece_state(piece, start, length)
                pieces.append({"name": self.names[piece.param], "geometry": geometry, "start": start,
                               "length": length, "values": values, "scalars": scalars})
        return {"pieces": pieces, "held": self.held(), "loss_scaler": self.optimizer.loss_scaler.state_dict()}

    def holds_the_same(self, saved: dict) -> bool:
        """Whether ``saved`` came from a rank holding the same parameters (its rank states then apply)."""
        held = saved.get("held")
        if held is None:  # format 2-3: every piece the rank held is in its file
            held = sorted({piece["name"] for piece in saved["pieces"]})
        return self.held() == held

    def load(self, source, weights_only: bool, loss_scaler: dict | None = None) -> None:
        """Fill this rank's masters (and, unless ``weights_only``, its optimizer states and the loss scale
        ``loss_scaler``) from ``source`` (a ``reshard.PieceSource``) by parameter name; the parameters
        take the values at ``masters_to_parameters``."""
        reshard.load(source, self.optimizer, self.names, *self._places(), weights_only, loss_scaler)

    def masters_to_parameters(self) -> None:
        """Every parameter takes its master's value (a collective over data parallelism)."""
        self.optimizer.masters_to_parameters()
