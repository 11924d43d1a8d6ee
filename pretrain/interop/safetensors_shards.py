"""Safetensors output cut into shards as Hugging Face cuts it: ``model-00001-of-00003.safetensors`` ...
beside ``model.safetensors.index.json`` ({"metadata": {"total_size"}, "weight_map": {name: shard}}),
or one file when everything fits in one shard. Plans the cut and writes the index; the tensors are
written by ``parallel.zero.export.StreamedSafetensors``, one writer per shard."""

from __future__ import annotations

import json
import math
import os
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number of bytes (ValueError naming ``flag``)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not found or found.group(2).upper() not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"{flag} {text}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def plan_shards(path: str, entries: list[tuple[str, tuple[int, ...]]], element_size: int,
                max_bytes: int | None) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(file, its entries) for each shard of ``entries`` in order, each at most ``max_bytes`` of tensor
    data unless one tensor alone is larger; ``path`` itself when one shard holds everything."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = element_size * math.prod(shape)
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    if len(shards) == 1:
        return [(path, shards[0])]
    stem = path[:-len(".safetensors")] if path.endswith(".safetensors") else path
    return [(f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors", shard)
            for number, shard in enumerate(shards, start=1)]


def write_index(path: str, shards: list[tuple[str, list]], element_size: int) -> None:
    """``path + ".index.json"``: every tensor's shard (by file name) and the total size."""
    total = sum(element_size * math.prod(shape) for _, entries in shards for _, shape in entries)
    weight_map = {name: os.path.basename(file) for file, entries in shards for name, _ in entries}
    with open(path + ".index.json.part", "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=1)
    os.replace(path + ".index.json.part", path + ".index.json")
