"""A PyTorch Distributed Checkpoint folder (``.metadata`` and ``__R_N.distcp`` files) read a region at a
time, with no process group: the way megatron-core's ``torch_dist`` and torchtitan save.

The metadata is unpickled with DCP's records alone allowed (``safe_pickle``); each stored chunk is read
from its file region, a ``torch.save`` stream loaded with ``weights_only=True`` or, in DCP's raw format,
the bytes themselves. ``read(key, first, count)`` assembles rows ``[first, first + count)`` of a tensor's
first axis from the chunks that overlap them, so a stacked layer tensor is read one layer at a time.
Owns the open files; never keeps a chunk.
"""

from __future__ import annotations

import io
import math
import os

import torch

from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.safe_pickle import load_dcp_metadata, load_failure

ZIP_MAGIC = b"PK\x03\x04"


class DCPFolder:
    """The tensors of one Distributed Checkpoint folder by key: their global shapes and dtypes, and any
    rows of them; byte items (saved objects) as ``weights_only`` loads them. ``check(file)``, where given,
    is called once per file before its first read (and raises for a file that must not be read)."""

    def __init__(self, folder: str, check=None):
        self.folder, self._check, self._checked = folder, check, set()
        self.metadata = load_dcp_metadata(os.path.join(folder, ".metadata"))
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.tensors = {key: value for key, value in self.metadata.state_dict_metadata.items()
                        if isinstance(value, TensorStorageMetadata)}
        self.storage = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
                        for index, info in self.metadata.storage_data.items()}
        for (key, _), info in self.storage.items():
            if not os.path.isfile(os.path.join(folder, info.relative_path)):
                raise CheckpointError(f"{os.path.join(folder, info.relative_path)}: missing (it holds "
                                      f"{key}); nothing was loaded")
            if os.path.basename(info.relative_path) != info.relative_path:
                raise CheckpointError(f"{folder}/.metadata: names {info.relative_path!r}, a file outside its "
                                      "folder; refused, nothing was loaded")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{folder}: {info.relative_path} is stored with transforms "
                                      f"{info.transform_descriptors} this reader does not apply")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Rows ``[first, first + count)`` of the first axis of tensor ``key`` (all: ``count`` None), in
        its saved dtype; CheckpointError naming a file that is missing or short, or rows no chunk holds."""
        if key not in self.tensors:
            raise CheckpointError(f"{self.folder}: holds no tensor {key}")
        shape = self.shape(key)
        count = shape[0] - first if count is None and shape else (count or 1)
        out_shape = (count, *shape[1:]) if shape else ()
        out = torch.empty(out_shape, dtype=self.dtype(key))
        covered = 0
        for chunk in self.tensors[key].chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            low, high = ((max(first, offsets[0]), min(first + count, offsets[0] + sizes[0])) if shape
                         else (0, 1))
            if low >= high:
                continue
            values = self._chunk(key, offsets, sizes)
            if not shape:
                out.copy_(values)
                covered += 1
                continue
            region = [slice(low - first, high - first)] + [slice(o, o + s)
                                                           for o, s in zip(offsets[1:], sizes[1:])]
            out[tuple(region)].copy_(values[low - offsets[0]:high - offsets[0]])
            covered += (high - low) * math.prod(sizes[1:])
        if covered != out.numel():
            raise CheckpointError(f"{self.folder}: the chunks of {key} do not cover rows {first}-"
                                  f"{first + count - 1} (a shard missing from the metadata)")
        return out

    def read_object(self, key: str):
        """The object stored as byte item ``key`` (a ``torch.save`` stream), loaded with
        ``weights_only=True``: plain containers, numbers, strings and tensors only."""
        info = self.storage.get((key, None))
        if info is None:
            raise CheckpointError(f"{self.folder}: holds no object {key}")
        try:
            return torch.load(io.BytesIO(self._bytes(key, info)), map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{self.folder}: object {key} refused by torch.load(weights_only=True): "
                                  f"{load_failure(error)}") from None

    def _bytes(self, key: str, info) -> bytes:
        path = os.path.join(self.folder, info.relative_path)
        if self._check is not None and info.relative_path not in self._checked:
            self._check(info.relative_path)  # (our own checkpoints: the file's sha256, once)
            self._checked.add(info.relative_path)
        try:
            with open(path, "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (it holds {key}); nothing was loaded") from None
        if len(data) != info.length:
            raise CheckpointError(f"{path}: shorter than its metadata says ({key}); nothing was loaded")
        return data

    def _chunk(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        info = self.storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.folder}: no stored data for {key} at {list(offsets)}")
        path = os.path.join(self.folder, info.relative_path)
        data = self._bytes(key, info)
        dtype = self.dtype(key)
        if data[:4] == ZIP_MAGIC:
            try:
                values = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as error:
                raise CheckpointError(f"{path}: {key} refused by torch.load(weights_only=True): "
                                      f"{load_failure(error)}") from None
        else:
            values = torch.frombuffer(bytearray(data), dtype=dtype)
        if not isinstance(values, torch.Tensor) or values.numel() != math.prod(sizes):
            raise CheckpointError(f"{path}: {key} at {list(offsets)} is not the {list(sizes)} tensor its "
                                  "metadata names; refused")
        return values.reshape(sizes).to(dtype)
