"""Our checkpoints as a PyTorch Distributed Checkpoint (``--ckpt-format torch_dcp``): the folder torch's
``torch.distributed.checkpoint.load`` and ``format_utils.dcp_to_torch_save`` (and so torchtitan's tools)
read, written by every rank in parallel, and re-cut on load in any layout as our rank files are.

``iter_N/`` holds DCP's ``.metadata`` and one ``__R_0.distcp`` per rank beside our ``manifest.json``
(run states, layout, config, each file's size and sha256). DCP's keys are our layout-independent names:
``<name>`` the fp32 master weights, whole-tensor shaped (vocabulary padding left out),
``optimizer.state.<name>.<kind>`` the optimizer's per-element states (Adam's ``exp_avg``,
``exp_avg_sq``) and its scalars (``step``), ``rank.<RRRRR>`` a saved object with each rank's own states
(random streams, the loss scale). Each element is written once (``saved_pieces.writers``): a rank's range
of its tensor-parallel slice is cut into the boxes of the whole tensor that DCP's chunks are. A load reads
row bands of each tensor, each file's sha256 checked before its first read.

Owns no state and no process group: the checkpointer calls ``write_dcp`` and ``DCPPieces``.
"""

from __future__ import annotations

import glob
import math
import os
import warnings

import torch

from data.file_digest import files_sha256
from pretrain.checkpoint.catalog import DCP_METADATA, MODEL, verified
from pretrain.checkpoint.foreign.dcp_folder import DCPFolder
from pretrain.checkpoint.geometry import SliceGeometry
from pretrain.checkpoint.reshard import PieceSource, SavedPiece

STATES = "optimizer.state."
RANK_STATES = "rank.{:05d}"
BAND = 1 << 22  # elements of a tensor one piece of a load reads (16 MiB of fp32)


def boxes(shape: tuple[int, ...], start: int, length: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of the boxes that elements ``[start, start + length)`` of a row-major tensor of
    ``shape`` fill: at most two per dimension and one whole block."""
    if length <= 0:
        return []
    if len(shape) <= 1:
        return [((start,), (length,))] if shape else [((), ())]
    inner, end = math.prod(shape[1:]), start + length
    (first, head), (last, tail) = divmod(start, inner), divmod(end, inner)

    def row(index: int, low: int, high: int) -> list[tuple[tuple, tuple]]:
        return [((index, *offsets), (1, *sizes)) for offsets, sizes in boxes(shape[1:], low, high - low)]

    if first == last:
        return row(first, head, tail)
    found = row(first, head, inner) if head else []
    first += bool(head)
    if last > first:
        found.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    return found + (row(last, 0, tail) if tail else [])


def whole_boxes(geometry: SliceGeometry, start: int, length: int):
    """(offsets in the slice, offsets in the whole, sizes) of each box of the slice's range, the rows of
    a vocabulary table's padding left out."""
    shift = geometry.tp_rank * geometry.shape[geometry.tp_dim] if geometry.tp_dim is not None else 0
    for offsets, sizes in boxes(geometry.shape, start, length):
        whole = list(offsets)
        if geometry.tp_dim is not None:
            whole[geometry.tp_dim] += shift
        if geometry.rows is not None:
            sizes = (min(sizes[0], geometry.rows - whole[0]), *sizes[1:])
            if sizes[0] <= 0:
                continue
        yield offsets, tuple(whole), sizes


def _box_values(values: torch.Tensor, shape: tuple, start: int, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The box of a slice of ``shape`` at ``offsets`` as a view of ``values`` (its flat elements from
    ``start``)."""
    strides = [math.prod(shape[axis + 1:]) for axis in range(len(shape))]
    first = sum(offset * stride for offset, stride in zip(offsets, strides)) - start
    return values.as_strided(sizes, strides, values.storage_offset() + first)


def _write_items(content: dict, rank: int) -> tuple[dict, dict]:
    """(DCP's write items of this rank: (key, offsets) -> (WriteItem, its values), its objects)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def add(key: str, whole: tuple, sizes: tuple, shape: tuple, values: torch.Tensor) -> None:
        index = MetadataIndex(key, torch.Size(whole))
        kind = WriteItemType.SHARD if shape else WriteItemType.TENSOR
        data = TensorWriteData(ChunkStorageMetadata(torch.Size(whole), torch.Size(sizes)),
                               TensorProperties(dtype=values.dtype), torch.Size(shape))
        tensors[(key, whole)] = (WriteItem(index=index, type=kind, tensor_data=data), values)

    tensors: dict = {}
    model = content["states"][MODEL]
    for piece in model["pieces"]:
        geometry = SliceGeometry(tuple(piece["geometry"][0]), *piece["geometry"][1:])
        name, shape = piece["name"], geometry.whole_shape
        for kind, values in piece["values"].items():
            values = values if values.stride() == (1,) else values.contiguous()  # (boxes are strided views)
            key = name if kind == "master" else f"{STATES}{name}.{kind}"
            for offsets, whole, sizes in whole_boxes(geometry, piece["start"], piece["length"]):
                box = _box_values(values, geometry.shape, piece["start"], offsets, sizes)
                add(key, whole, sizes, shape, box)
                if kind == "master" and not any(whole):  # the writer of element 0 writes the scalars
                    for scalar, value in piece["scalars"].items():
                        add(f"{STATES}{name}.{scalar}", (), (), (), torch.as_tensor(value).detach().clone())
    rest = {"states": {**content["states"], MODEL: {k: v for k, v in model.items() if k != "pieces"}}}
    objects = {RANK_STATES.format(rank): (WriteItem(index=MetadataIndex(RANK_STATES.format(rank)),
                                                    type=WriteItemType.BYTE_IO), rest)}
    return tensors, objects


def _planner(items: dict):
    """DCP's default planner (its global plan, validation and metadata) over ``items`` instead of a state
    dict: each write item resolves to its values, contiguous when written."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class ChunkPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([item for item, _ in items.values()])
            return self.plan

        def lookup_object(self, index):
            value = items[(index.fqn, tuple(index.offset) if index.offset is not None else None)][1]
            return value.contiguous() if isinstance(value, torch.Tensor) else value

    return ChunkPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _dcp_save(state: dict, writer, **options) -> None:
    """torch's ``dcp.save``; with ``no_dist`` (one process, asked for) without torch's warning that it
    assumes so."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, **options)


def save_in_one_process(state: dict, folder: str) -> None:
    """``state`` saved into the DCP ``folder`` by this process alone."""
    import torch.distributed.checkpoint as dcp

    _dcp_save(state, dcp.FileSystemWriter(folder), no_dist=True)


def write_dcp(folder: str, content: dict, rank: int, group) -> list[tuple[str, int, str]]:
    """Write this rank's ``content`` (its states, as ``checkpointer.rank_content`` gives them) into the
    DCP ``folder`` (a collective over ``group``, the world); returns (file, bytes, sha256) of the files this
    rank wrote (rank 0: and the metadata)."""
    import torch.distributed.checkpoint as dcp

    tensors, objects = _write_items(content, rank)
    items = {**tensors, **{(key, None): value for key, value in objects.items()}}
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
    _dcp_save({}, writer, planner=_planner(items), process_group=group, no_dist=group is None)
    written = sorted(glob.glob(os.path.join(folder, f"__{rank}_*.distcp")))
    if rank == 0:
        written.append(os.path.join(folder, DCP_METADATA))
    return [(os.path.basename(path), os.path.getsize(path), files_sha256(path)) for path in written]


class DCPPieces(PieceSource):
    """The pieces of one of our checkpoints stored as DCP: each tensor's row bands (``BAND`` elements or
    one row), read as a rank needs them from the files, each file's sha256 checked against the manifest
    before its first read (a mismatch raises CheckpointError naming it). Keeps no tensor."""

    def __init__(self, checkpoint: str, manifest: dict):
        super().__init__()
        verified(checkpoint, manifest, DCP_METADATA)  # (before its pickle is read)
        self.folder = DCPFolder(checkpoint, check=lambda entry: verified(checkpoint, manifest, entry))
        kinds, self.scalar_kinds = set(), set()
        for key in self.folder.tensors:
            if key.startswith(STATES):
                (kinds if self.folder.shape(key) else self.scalar_kinds).add(key.rsplit(".", 1)[1])
                continue
            shape = self.folder.shape(key)
            per_row = math.prod(shape[1:])
            rows = max(1, BAND // max(per_row, 1))
            for first in range(0, shape[0], rows):
                count = min(rows, shape[0] - first)
                self.by_name[key].append(SavedPiece(key, SliceGeometry(shape), first * per_row,
                                                    count * per_row, (first, count)))
        self.kinds = tuple(sorted(kinds))

    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        key = piece.name if kind == "master" else f"{STATES}{piece.name}.{kind}"
        if key not in self.folder.tensors:
            return None
        return self.folder.read(key, *piece.where).reshape(-1)

    def scalars(self, name: str) -> dict:
        return {scalar: self.folder.read(f"{STATES}{name}.{scalar}") for scalar in sorted(self.scalar_kinds)
                if f"{STATES}{name}.{scalar}" in self.folder.tensors}

    def rank_states(self, rank: int) -> dict:
        """The states rank ``rank`` saved of its own (its random streams; the model's loss scale)."""
        return self.folder.read_object(RANK_STATES.format(rank))["states"]
