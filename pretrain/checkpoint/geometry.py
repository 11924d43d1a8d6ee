"""Where a range of a parameter's elements sits in the whole parameter, whatever the layout that holds it.

A rank holds a parameter as its tensor-parallel slice (split along ``tp_dim`` into ``tp_size`` equal
parts, the vocabulary tables padded to rows a layout chooses) and keeps a range of that slice's
flattened elements (``start``, ``length``). Seen as a matrix ``[outer, W]`` (``outer``: the product of the
dimensions before ``tp_dim``; ``W``: the rest), the slice of tp rank ``r`` is the column band
``[r w, (r + 1) w)`` of width ``w = W / tp_size``, and a range of it is at most three rectangles: a
partial first row, whole middle rows, a partial last row. Two ranges of two layouts overlap in at most
nine rectangles, each a strided view of both flat tensors: a re-cut copies them without building the
whole parameter or any index. A vocabulary table (split along its rows, ``tp_dim`` 0) has ``outer`` 1,
so its whole is one row whose first ``rows x columns`` elements are real and the rest padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


class GeometryError(ValueError):
    """Two layouts' views of one parameter that cannot be the same parameter (another model)."""


@dataclass(frozen=True)
class SliceGeometry:
    """A parameter's tensor-parallel slice: ``shape`` (this layout's, padded) of rank ``tp_rank`` of
    ``tp_size`` along ``tp_dim`` (None: replicated, the slice is the whole); ``rows``: the real rows of a
    padded vocabulary table (else None). Holds no tensor."""

    shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    rows: int | None = None

    @classmethod
    def of(cls, shape, tp_dim: int | None, tp_rank: int, tp_size: int, rows: int | None) -> SliceGeometry:
        """The geometry of a slice (a replicated parameter's is the whole, whatever the tp rank)."""
        if tp_dim is None:
            return cls(tuple(shape), None, 0, 1, rows)
        return cls(tuple(shape), tp_dim, tp_rank, tp_size, rows)

    @property
    def outer(self) -> int:
        return math.prod(self.shape[:self.tp_dim]) if self.tp_dim is not None else 1

    @property
    def width(self) -> int:
        """Elements of one row of the slice (``w``)."""
        return math.prod(self.shape) // self.outer if self.outer else 0

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The whole parameter's shape (slices joined, vocabulary padding removed)."""
        shape = list(self.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= self.tp_size
            if self.rows is not None:
                shape[self.tp_dim] = self.rows
        return tuple(shape)

    @property
    def real(self) -> int | None:
        """Elements of the whole row that are real (a padded vocabulary table), else None (all are)."""
        return None if self.rows is None else self.rows * math.prod(self.shape[1:])

    def as_whole(self) -> SliceGeometry:
        """The whole parameter seen with this one's split dimension (a slice of one, unpadded)."""
        return SliceGeometry(self.whole_shape, self.tp_dim, 0, 1, self.rows)


@dataclass(frozen=True)
class Block:
    """Rows ``[o0, o1)`` and columns ``[c0, c1)`` of the whole ``[outer, W]`` matrix."""

    o0: int
    o1: int
    c0: int
    c1: int


def blocks(geometry: SliceGeometry, start: int, length: int) -> list[Block]:
    """The rectangles of elements ``[start, start + length)`` of the flattened slice."""
    if length <= 0:
        return []
    w, base = geometry.width, geometry.tp_rank * geometry.width
    first, last = start // w, (start + length - 1) // w
    head, tail = start % w, (start + length - 1) % w + 1
    if first == last:
        return [Block(first, first + 1, base + head, base + tail)]
    found = [Block(first, first + 1, base + head, base + w)]
    if last > first + 1:
        found.append(Block(first + 1, last, base, base + w))
    return found + [Block(last, last + 1, base, base + tail)]


def check_same_parameter(name: str, saved: SliceGeometry, held: SliceGeometry) -> None:
    """GeometryError unless ``saved`` and ``held`` are slices of one parameter."""
    if saved.whole_shape != held.whole_shape or (saved.tp_dim is not None and held.tp_dim is not None
                                                 and saved.tp_dim != held.tp_dim):
        raise GeometryError(f"{name}: saved as {saved.whole_shape} (split along {saved.tp_dim}), this model "
                            f"has {held.whole_shape} (split along {held.tp_dim}): another model (compare "
                            "the shape flags with the checkpoint's manifest config)")


def _in_coordinates_of(saved: SliceGeometry, held: SliceGeometry) -> SliceGeometry:
    """``saved`` seen with ``held``'s split dimension: a whole (replicated) saved parameter takes the
    held one's, so that both name the same ``[outer, W]`` matrix."""
    if saved.tp_dim is None and held.tp_dim is not None:
        return SliceGeometry(saved.shape, held.tp_dim, 0, 1, saved.rows)
    return saved


def _view(flat: torch.Tensor, geometry: SliceGeometry, start: int, o0: int, o1: int, c0: int, c1: int):
    """Rows ``[o0, o1)`` x columns ``[c0, c1)`` of the whole matrix, as a view of ``flat`` (the slice's
    elements from ``start``)."""
    w = geometry.width
    first = o0 * w + c0 - geometry.tp_rank * w - start
    return flat.as_strided((o1 - o0, c1 - c0), (w, 1), flat.storage_offset() + first)


def _shared(saved: SliceGeometry, saved_start: int, saved_length: int, held: SliceGeometry, held_start: int,
            held_length: int):
    """(saved, held, o0, o1, c0, c1) for each rectangle the two ranges share (both geometries as seen in
    one coordinate system)."""
    saved = _in_coordinates_of(saved, held)
    if held.tp_dim is None and saved.tp_dim is not None:
        held = SliceGeometry(held.shape, saved.tp_dim, 0, 1, held.rows)
    limit = held.real if held.real is not None else saved.real
    for ours in blocks(held, held_start, held_length):
        for theirs in blocks(saved, saved_start, saved_length):
            o0, o1 = max(ours.o0, theirs.o0), min(ours.o1, theirs.o1)
            c0, c1 = max(ours.c0, theirs.c0), min(ours.c1, theirs.c1)
            if limit is not None:
                c1 = min(c1, limit)
            if o0 < o1 and c0 < c1:
                yield saved, held, o0, o1, c0, c1


def copy_overlap(source: Callable[[], torch.Tensor | None], saved: SliceGeometry, saved_start: int,
                 saved_length: int, target: torch.Tensor, held: SliceGeometry, held_start: int,
                 covered: torch.Tensor) -> None:
    """Copy the elements that ``saved``'s range ``[saved_start, saved_start + saved_length)`` shares with
    ``target`` (``held``'s elements from ``held_start``) into ``target``, and mark them in ``covered``
    (bool, like ``target``). ``source()`` gives the saved range's values (flat; None: zeros, a state the
    optimizer never made), asked for only when the ranges share an element."""
    values = None
    for index, (saved_seen, held_seen, o0, o1, c0, c1) in enumerate(
            _shared(saved, saved_start, saved_length, held, held_start, target.numel())):
        if index == 0:
            values = source()
        if values is not None:
            _view(target, held_seen, held_start, o0, o1, c0, c1).copy_(
                _view(values, saved_seen, saved_start, o0, o1, c0, c1))
        _view(covered, held_seen, held_start, o0, o1, c0, c1).fill_(True)


def shared_blocks(source: torch.Tensor | None, saved: SliceGeometry, saved_start: int, saved_length: int,
                  whole: SliceGeometry):
    """(offset in the whole, row stride, values [rows, columns]) of each rectangle of ``saved``'s range
    within ``whole`` (a whole geometry, ``as_whole``): row ``i`` of the values sits at element
    ``offset + i * stride`` of the whole, row-major. ``source`` None gives zeros."""
    for saved_seen, whole_seen, o0, o1, c0, c1 in _shared(saved, saved_start, saved_length, whole, 0,
                                                          math.prod(whole.shape)):
        values = (torch.zeros(o1 - o0, c1 - c0) if source is None
                  else _view(source, saved_seen, saved_start, o0, o1, c0, c1))
        yield o0 * whole_seen.width + c0, whole_seen.width, values


def mark_padding(held: SliceGeometry, held_start: int, covered: torch.Tensor) -> None:
    """Mark in ``covered`` the elements of ``held``'s range that are vocabulary padding (no layout saves
    them: they stay zero)."""
    if held.real is None:
        return
    for block in blocks(held, held_start, covered.numel()):
        c0 = max(block.c0, held.real)
        if c0 < block.c1:
            _view(covered, held, held_start, block.o0, block.o1, c0, block.c1).fill_(True)
