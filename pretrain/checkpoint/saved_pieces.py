"""The pieces of a checkpoint (rank-file format 4): who writes which elements, what each piece records,
and its digest.

Every rank holds ranges of parameters (its masters); ranges held by several ranks (replicated over dp
at ZeRO stage 0 or under MiCS / HSDP, over tp for the weights tensor parallelism does not split, the
tied embedding's copy on the last stage) are cut so that each element is written by exactly one of the
ranks holding it, the cut spread evenly over them: every rank writes about total / world bytes
(Megatron's fully parallel save). A piece is one written range::

    {"name": the parameter's layout-independent name,
     "geometry": [slice shape, tp_dim, tp_rank, tp_size, unpadded rows]  (pretrain.checkpoint.geometry),
     "start": first element of the slice, "length": elements,
     "values": {"master": fp32 values, "exp_avg": ..., ...}  (compact tensors: only these elements),
     "scalars": {"step": ...}}

The manifest lists each file's pieces (``listing``) with their sha256 (``digest``), so that a rank
reading a piece checks exactly what it reads, and the digest of the rest of the file (its random
streams, the loss scale). Owns no state: ``ZeroModelState`` builds pieces, the checkpointer writes
and lists them, and ``reshard`` reads them.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict

import torch

from pretrain.checkpoint.geometry import SliceGeometry


def writers(held: list[list[tuple[tuple, int, int]]]) -> list[list[list[tuple[int, int]]]]:
    """Who writes what: ``held[rank]`` lists that rank's ranges as (key, start, length), where ranges of
    one key on several ranks hold the same values; returns, for each rank and each of its ranges, the
    sub-ranges (start, length) it writes. Every element of every key is written once, and where several
    ranks hold it, the elements are split evenly (contiguously, in rank order) among them."""
    events: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(lambda: [[], []]))
    for rank, ranges in enumerate(held):
        for index, (key, start, length) in enumerate(ranges):
            if length > 0:
                events[key][start][0].append((rank, index))
                events[key][start + length][1].append((rank, index))
    written: list[list[list[tuple[int, int]]]] = [[[] for _ in ranges] for ranges in held]
    for by_position in events.values():
        active: set[tuple[int, int]] = set()
        positions = sorted(by_position)
        for low, high in zip(positions, positions[1:]):
            starting, ending = by_position[low]
            active |= set(starting)
            active -= set(ending)
            holders = sorted(active)
            for order, (rank, index) in enumerate(holders):
                a = low + (high - low) * order // len(holders)
                b = low + (high - low) * (order + 1) // len(holders)
                if b <= a:
                    continue
                mine = written[rank][index]
                if mine and mine[-1][0] + mine[-1][1] == a:  # continues the previous sub-range
                    mine[-1] = (mine[-1][0], mine[-1][1] + b - a)
                else:
                    mine.append((a, b - a))
    return written


def geometry_entry(geometry: SliceGeometry) -> list:
    """A geometry as a piece records it: [slice shape, tp_dim, tp_rank, tp_size, unpadded rows]."""
    return [list(geometry.shape), geometry.tp_dim, geometry.tp_rank, geometry.tp_size, geometry.rows]


def _feed(digest, value) -> None:
    """Feed ``value`` (nested dicts, lists, tensors and plain values) into ``digest`` unambiguously."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1).contiguous()
        digest.update(f"T{flat.dtype}{list(value.shape)}:".encode())
        if flat.numel():
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}:".encode())
        for key in sorted(value, key=str):
            _feed(digest, str(key))
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    else:
        encoded = json.dumps(value).encode()
        digest.update(f"V{len(encoded)}:".encode() + encoded)


def digest(value) -> str:
    """The sha256 of ``value``'s contents (tensors by their bytes, dtype and shape)."""
    found = hashlib.sha256()
    _feed(found, value)
    return found.hexdigest()


def listing(piece: dict, sha256: str) -> list:
    """A piece's entry in the manifest: [name, geometry, start, length, its kinds, sha256]."""
    return [piece["name"], list(piece["geometry"]), piece["start"], piece["length"], sorted(piece["values"]),
            sha256]


def index_of(model_state: dict, rest: dict) -> tuple[list[list], str]:
    """(the manifest's listing of ``model_state``'s pieces, the digest of ``rest``: the file's other
    contents)."""
    return [listing(piece, digest(piece)) for piece in model_state["pieces"]], digest(rest)
