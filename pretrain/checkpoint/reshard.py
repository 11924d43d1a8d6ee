"""Fill a model's masters and optimizer states from a checkpoint of any layout (dp, tp, pp, ZeRO stage,
vp), or the same one, by parameter name, streamed.

A source lists the saved pieces of each parameter (``pretrain.checkpoint.saved_pieces``; an older rank
file's master ranges; a weights file's whole tensors) with their geometry. A rank fills each of its own
master ranges from the saved pieces that overlap it, copying the shared rectangles
(``pretrain.checkpoint.geometry``) straight from the memory-mapped files: it reads only the pieces that
overlap its own (a format-4 checkpoint checks each one's sha256 as it is read), never builds a whole
parameter, and its extra memory is one flag per element of the range it fills. ``whole`` rebuilds one
whole parameter, for conversion and one-process loading. The dropout streams start afresh (they depend
on the layout).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel.param_meta import meta
from parallel.zero.masters import MasterPiece
from parallel.zero.optimizer import ZeroOptimizer
from parallel.zero.state_readers import saved_kinds, saved_piece, saved_scalars
from pretrain.checkpoint.catalog import MODEL, CheckpointError
from pretrain.checkpoint.geometry import (GeometryError, SliceGeometry, check_same_parameter, copy_overlap,
                                          mark_padding, shared_blocks)
from pretrain.checkpoint.saved_pieces import digest, listing, writers


class ReshardError(ValueError):
    """The checkpoint cannot fill this model (another model, or pieces missing); names the parameter."""


def held_geometry(param: nn.Parameter, shape, tp: tuple[int, int],
                  expert_tp: tuple[int, int] | None = None) -> SliceGeometry:
    """The geometry of this rank's tensor-parallel slice of ``param`` (of shape ``shape``): ``tp`` is this
    rank's (rank, size) in the tp group, ``expert_tp`` in the expert tp group (an expert's slices)."""
    rank, size = expert_tp if meta(param).expert and expert_tp is not None else tp
    return SliceGeometry.of(shape, meta(param).partition_dim, rank, size, meta(param).unpadded_rows)


@dataclass(frozen=True)
class SavedPiece:
    """Elements ``[start, start + length)`` of a saved slice of parameter ``name``, and where to read them
    (``where``: the source's own handle, a file entry and position)."""

    name: str
    geometry: SliceGeometry
    start: int
    length: int
    where: tuple = ()


class PieceSource:
    """The saved pieces of every parameter, by name (``by_name``), and the per-element optimizer states
    they hold (``kinds``). Fills any range of any layout from them; never keeps what it read."""

    kinds: tuple[str, ...] = ()

    def __init__(self):
        self.by_name: dict[str, list[SavedPiece]] = defaultdict(list)
        self.problems: list[str] = []  # what a check found while reading (the caller agrees and raises)

    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        """``piece``'s elements of ``kind`` (flat), or None where the optimizer never made that state."""
        raise NotImplementedError

    def scalars(self, name: str) -> dict:
        """The optimizer's per-parameter scalars (Adam's step) of ``name``."""
        return {}

    def pieces(self, name: str) -> list[SavedPiece]:
        if name not in self.by_name:
            raise ReshardError(f"{name}: not in the checkpoint (another model?)")
        return self.by_name[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole parameter's shape (tensor-parallel slices joined, vocabulary padding removed)."""
        return self.pieces(name)[0].geometry.whole_shape

    def fill(self, name: str, held: SliceGeometry, start: int, kind: str, target: torch.Tensor) -> None:
        """Write elements ``[start, start + target.numel())`` of the slice ``held`` of ``name`` (state
        ``kind``) into ``target``: zeros where the optimizer never made the state, and in the
        vocabulary padding."""
        pieces = self.pieces(name)
        try:
            for piece in pieces:
                check_same_parameter(name, piece.geometry, held)
        except GeometryError as error:
            raise ReshardError(str(error)) from None
        covered = torch.zeros(target.numel(), dtype=torch.bool)
        target.zero_()
        mark_padding(held, start, covered)
        for piece in pieces:
            copy_overlap(lambda piece=piece: self.values(piece, kind), piece.geometry, piece.start,
                         piece.length, target, held, start, covered)
        if not bool(covered.all()):
            raise ReshardError(f"{name}: the checkpoint lacks part of the elements this rank holds (a rank "
                               "file of another run, or one missing)")

    def whole(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter ``name`` (its fp32 masters, or optimizer state ``kind``)."""
        held = self.pieces(name)[0].geometry.as_whole()
        whole = torch.empty(held.whole_shape, dtype=torch.float32)
        self.fill(name, held, 0, kind, whole.view(-1))
        return whole

    def stream(self, name: str, kind: str, write: Callable[[int, torch.Tensor], None]) -> None:
        """Hand every saved element of ``name`` (state ``kind``; zeros where the optimizer never made it)
        to ``write(offset, values)``: runs of the whole, unpadded, row-major tensor from element
        ``offset``, one piece at a time, never the whole tensor (the pieces are disjoint: each element
        comes once)."""
        pieces = self.pieces(name)
        whole = pieces[0].geometry.as_whole()
        for piece in pieces:
            values = self.values(piece, kind)
            for offset, stride, block in shared_blocks(values, piece.geometry, piece.start, piece.length,
                                                       whole):
                if block.shape[0] == 1 or block.shape[1] == stride:  # whole rows: one run
                    write(offset, block.reshape(-1))
                else:
                    for row in range(block.shape[0]):
                        write(offset + row * stride, block[row])


class SavedPieces(PieceSource):
    """The pieces of a format-4 checkpoint, listed by its manifest. A rank file is opened (memory-mapped)
    when a piece in it is first needed; each piece's sha256 is checked as it is first read, and a
    mismatch is recorded in ``problems`` naming the file (``strict``: raised at once as CheckpointError,
    for one process)."""

    def __init__(self, checkpoint: str, manifest: dict, open_file, strict: bool = False):
        super().__init__()
        self.checkpoint, self.manifest, self._open, self.strict = checkpoint, manifest, open_file, strict
        self._files: dict[str, dict] = {}
        self._checked: set[tuple[str, int]] = set()
        kinds = set()
        for entry, recorded in sorted(manifest["files"].items()):
            for index, item in enumerate(recorded.get("pieces", [])):
                name, geometry, start, length, piece_kinds, _ = item
                shape, tp_dim, tp_rank, tp_size, rows = geometry
                self.by_name[name].append(SavedPiece(name, SliceGeometry(tuple(shape), tp_dim, tp_rank,
                                                                         tp_size, rows),
                                                     start, length, (entry, index)))
                kinds.update(piece_kinds)
        self.kinds = tuple(sorted(kinds - {"master"}))

    def _damaged(self, problem: str) -> None:
        if self.strict:
            raise CheckpointError(problem)
        self.problems.append(problem)

    def file(self, entry: str) -> dict:
        """Rank file ``entry``'s contents (memory-mapped; opened once)."""
        if entry not in self._files:
            self._files[entry] = self._open(self.checkpoint, self.manifest, entry)
        return self._files[entry]

    def _piece(self, piece: SavedPiece) -> dict:
        entry, index = piece.where
        found = self.file(entry)["states"][MODEL]["pieces"][index]
        if (entry, index) not in self._checked:
            self._checked.add((entry, index))
            recorded = self.manifest["files"][entry]["pieces"][index]
            if listing(found, digest(found)) != recorded:
                self._damaged(f"{self.checkpoint}/{entry}: piece {index} ({piece.name}) differs from its "
                              "sha256 in the manifest (corrupted)")
        return found

    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        return self._piece(piece)["values"].get(kind)

    def scalars(self, name: str) -> dict:
        return self._piece(self.pieces(name)[0])["scalars"]

    def rest(self, entry: str) -> dict:
        """Rank file ``entry``'s states but for its pieces (its random streams, the names it held, the loss
        scale), checked against the manifest's digest."""
        states = self.file(entry)["states"]
        rest = {"states": {**states, MODEL: {k: v for k, v in states[MODEL].items() if k != "pieces"}}}
        if (entry, -1) not in self._checked:
            self._checked.add((entry, -1))
            if digest(rest) != self.manifest["files"][entry].get("rest"):
                self._damaged(f"{self.checkpoint}/{entry}: its states differ from their sha256 in the "
                              "manifest (corrupted)")
        return rest["states"]


class LegacyPieces(PieceSource):
    """The pieces of a format-2 or -3 checkpoint: each rank file's master ranges, read out of its
    ``ZeroOptimizer.state_dict()``. Every replica wrote its ranges; each element is taken from one."""

    def __init__(self, states: list[dict]):
        super().__init__()
        self.states = states
        held, geometries = [], []
        for state in states:
            ranges, shapes = [], []
            for piece in state["pieces"]:
                geometry = SliceGeometry.of(piece["shape"], piece["tp_dim"], piece["tp_rank"],
                                            piece["tp_size"], piece["rows"])
                ranges.append(((piece["name"], geometry.tp_rank), piece["start"], piece["length"]))
                shapes.append(geometry)
            held.append(ranges)
            geometries.append(shapes)
        for number, per_piece in enumerate(writers(held)):
            for index, parts in enumerate(per_piece):
                name = states[number]["pieces"][index]["name"]
                for start, length in parts:
                    self.by_name[name].append(SavedPiece(name, geometries[number][index], start, length,
                                                         (number, index)))
        self.kinds = tuple(sorted(set().union(*(saved_kinds(state["optimizer"]) for state in states))))

    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        number, index = piece.where
        state = self.states[number]
        saved = state["pieces"][index]
        source = saved_piece(state["optimizer"], saved["master"], saved["state"], kind)
        if source is None:
            return None
        low = saved["offset"] + piece.start - saved["start"]
        return source[low:low + piece.length].float()

    def scalars(self, name: str) -> dict:
        number, index = self.pieces(name)[0].where
        return saved_scalars(self.states[number]["optimizer"], self.states[number]["pieces"][index]["state"])


class WeightsFile(PieceSource):
    """The whole fp32 weights of a model in one safetensors file under layout-independent names (what
    ``pretrain.interop.convert`` writes and a Hugging Face import makes): each tensor one piece, no
    optimizer state. Opened memory-mapped; a tensor is read when a range of it is asked for."""

    def __init__(self, path: str):
        from safetensors import safe_open

        super().__init__()
        self.path = path
        self._file = safe_open(path, framework="pt")
        self._last: tuple[str, torch.Tensor] | None = None
        for name in self._file.keys():
            shape = tuple(self._file.get_slice(name).get_shape())
            self.by_name[name].append(SavedPiece(name, SliceGeometry(shape), 0, math.prod(shape)))

    def pieces(self, name: str) -> list[SavedPiece]:
        if name not in self.by_name:
            raise ReshardError(f"{name}: not in {self.path} (another model?)")
        return self.by_name[name]

    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        if kind != "master":
            return None
        if self._last is None or self._last[0] != piece.name:  # one tensor kept: a rank's ranges of it
            self._last = (piece.name, self._file.get_tensor(piece.name).float().reshape(-1))
        return self._last[1]


def load(source: PieceSource, optimizer: ZeroOptimizer, names: dict[nn.Parameter, str], tp: tuple[int, int],
         expert_tp: tuple[int, int] | None = None, weights_only: bool = False,
         loss_scaler_state: dict | None = None) -> None:
    """Fill ``optimizer``'s masters and, unless ``weights_only``, its per-element states from ``source``,
    whatever layout wrote it (``tp``, ``expert_tp``: this rank's (rank, size) in its tp and expert tp
    groups). ``weights_only`` leaves the optimizer fresh (fine-tuning). The parameters
    take the masters' values at ``optimizer.masters_to_parameters()``, the caller's to call."""

    def fill(piece: MasterPiece, kind: str, target: torch.Tensor) -> None:
        source.fill(names[piece.param], held_geometry(piece.param, piece.shape, tp, expert_tp),
                    piece.start, kind, target)

    optimizer.load_by_parameter(fill, [] if weights_only else list(source.kinds),
                                None if weights_only else lambda piece: source.scalars(names[piece.param]),
                                None if weights_only else loss_scaler_state)
