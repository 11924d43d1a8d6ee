"""Re-cut a checkpoint's masters and optimizer states for another layout (dp, tp, pp, ZeRO stage, vp).

Every rank file records where each parameter's elements sit in its masters (``describe``): the
parameter's layout-independent name, its tensor-parallel slice (dimension, rank, size, padded rows)
and the element range of that slice. A rank of the new layout rebuilds, one parameter at a time, the
whole parameter's master values and per-element optimizer states from the pieces in the old files
(opened memory-mapped, so only the pieces read come off the disk), cuts its own tensor-parallel slice
and the element ranges its own masters hold, and drops the rest. No rank ever holds more than one
whole parameter beyond its own shard. The dropout streams start afresh (they depend on the layout).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn

from parallel.param_meta import meta
from parallel.zero.masters import MasterPiece
from parallel.zero.optimizer import ZeroOptimizer
from parallel.zero.state_readers import saved_kinds, saved_piece, saved_scalars


class ReshardError(ValueError):
    """The checkpoint cannot fill this model (another model, or pieces missing); names the parameter."""


def _tp_slice(param: nn.Parameter) -> tuple[int | None, int | None]:
    """(the dimension tensor parallelism splits, or None for a replicated parameter; the unpadded rows
    along it for a padded vocabulary table, else None)."""
    return meta(param).partition_dim, meta(param).unpadded_rows


def describe(optimizer: ZeroOptimizer, names: dict[nn.Parameter, str], tp_rank: int,
             tp_size: int) -> list[dict]:
    """This rank's pieces: which elements of which named parameter each master range holds."""
    pieces = []
    for piece in optimizer.master_pieces():
        dim, rows = _tp_slice(piece.param)
        pieces.append({"name": names[piece.param], "master": piece.master, "state": piece.state,
                       "start": piece.start, "offset": piece.offset, "length": piece.length,
                       "shape": list(piece.shape), "tp_dim": dim, "tp_rank": tp_rank, "tp_size": tp_size,
                       "rows": rows})
    return pieces


class CheckpointPieces:
    """The pieces of every parameter in a checkpoint's rank files (their contents, memory-mapped). Owns
    the index by name; rebuilds one whole parameter (masters or a per-element optimizer state) on
    request and never keeps it."""

    def __init__(self, states: list[dict]):
        self.states = states
        self.by_name: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
        for state in states:
            for piece in state["pieces"]:
                self.by_name[piece["name"]].append((state, piece))
        self.kinds = sorted(set().union(*(saved_kinds(state["optimizer"]) for state in states)))

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole parameter's shape (tensor-parallel slices joined, vocabulary padding removed)."""
        if name not in self.by_name:
            raise ReshardError(f"{name}: not in the checkpoint (another model?)")
        piece = self.by_name[name][0][1]
        shape = list(piece["shape"])
        if piece["tp_dim"] is not None:
            shape[piece["tp_dim"]] *= piece["tp_size"]
        if piece["rows"] is not None:
            shape[piece["tp_dim"]] = piece["rows"]
        return tuple(shape)

    def scalars(self, name: str) -> dict:
        """The optimizer's per-parameter scalars (e.g. Adam's step count) of ``name``."""
        state, piece = self.by_name[name][0]
        return saved_scalars(state["optimizer"], piece["state"])

    def whole(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter ``name``: its fp32 masters, or optimizer state ``kind`` (zero where the
        optimizer never stepped)."""
        if name not in self.by_name:
            raise ReshardError(f"{name}: not in the checkpoint (another model?)")
        entries = self.by_name[name]
        slices: dict[int, torch.Tensor] = {}
        filled: dict[int, torch.Tensor] = {}
        for state, piece in entries:
            rank = piece["tp_rank"]
            if rank not in slices:
                slices[rank] = torch.zeros(math.prod(piece["shape"]), dtype=torch.float32)
                filled[rank] = torch.zeros(math.prod(piece["shape"]), dtype=torch.bool)
            source = saved_piece(state["optimizer"], piece["master"], piece["state"], kind)
            span = slice(piece["start"], piece["start"] + piece["length"])
            filled[rank][span] = True
            if source is not None:
                slices[rank][span] = source[piece["offset"]:piece["offset"] + piece["length"]].float()
        first = entries[0][1]
        ranks = list(range(first["tp_size"])) if first["tp_dim"] is not None else [min(slices)]
        for rank in ranks:
            if rank not in filled or not bool(filled[rank].all()):
                raise ReshardError(f"{name}: the checkpoint lacks part of tensor-parallel slice {rank} "
                                   "(a rank "
                                   "file of another run, or one missing)")
        if first["tp_dim"] is None:
            whole = slices[ranks[0]].view(first["shape"])
        else:
            whole = torch.cat([slices[r].view(first["shape"]) for r in ranks], dim=first["tp_dim"])
        if first["rows"] is not None:
            whole = whole.narrow(first["tp_dim"], 0, first["rows"])
        return whole


def _my_slice(whole: torch.Tensor, piece: MasterPiece, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's tensor-parallel slice of ``whole`` for ``piece``'s parameter, padded as this layout
    pads the vocabulary, flattened."""
    dim, rows = _tp_slice(piece.param)
    if rows is not None:  # pad the vocabulary rows back to this layout's padded size
        pad = [0, 0] * (whole.dim() - 1 - dim) + [0, piece.shape[dim] * tp_size - whole.shape[dim]]
        whole = torch.nn.functional.pad(whole, pad)
    if dim is not None:
        whole = whole.chunk(tp_size, dim=dim)[tp_rank]
    if whole.shape != piece.shape:
        raise ReshardError(f"its slice of shape {tuple(whole.shape)} cannot fill this model's "
                           f"{tuple(piece.shape)} "
                           "(another model: compare the shape flags with the checkpoint's manifest config)")
    return whole.reshape(-1)


class WeightsFile:
    """The whole fp32 weights of a model in one safetensors file under layout-independent names (what
    ``pretrain.interop.convert`` writes and a Hugging Face import makes): a source of masters for ``load``
    with no optimizer state. Opened memory-mapped; each parameter is read when asked for, and only the rank's
    slices are kept."""

    kinds: tuple[str, ...] = ()  # no optimizer state

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self._file = safe_open(path, framework="pt")
        self.by_name = set(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.by_name:
            raise ReshardError(f"{name}: not in {self.path} (another model?)")
        return tuple(self._file.get_slice(name).get_shape())

    def whole(self, name: str, kind: str = "master") -> torch.Tensor:
        self.shape(name)
        return self._file.get_tensor(name).float()

    def scalars(self, name: str) -> dict:
        return {}


def load(source, optimizer: ZeroOptimizer, names: dict[nn.Parameter, str], tp_rank: int, tp_size: int,
         weights_only: bool = False, loss_scaler_state: dict | None = None) -> None:
    """Fill ``optimizer``'s masters (then its parameters) and, unless ``weights_only``, its per-element
    states from ``source`` (``CheckpointPieces`` of another layout's rank files, or a ``WeightsFile``),
    whatever layout wrote them. ``weights_only`` leaves the optimizer fresh (fine-tuning)."""

    def values(piece: MasterPiece, kind: str) -> torch.Tensor:
        whole = source.whole(names[piece.param], kind)
        try:
            return _my_slice(whole, piece, tp_rank, tp_size)
        except ReshardError as error:
            raise ReshardError(f"{names[piece.param]}: {error}") from None

    optimizer.load_by_parameter(values, [] if weights_only else list(source.kinds),
                                None if weights_only else lambda piece: source.scalars(names[piece.param]),
                                None if weights_only else loss_scaler_state)
