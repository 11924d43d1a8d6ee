"""Checkpoint pieces without a model: who writes which elements (each once, spread over the replicas),
and the re-cut by rectangles against plain slicing of the whole tensor, for random shapes, splits,
vocabulary paddings and cuts."""

import random

import torch

from pretrain.checkpoint.geometry import SliceGeometry
from pretrain.checkpoint.reshard import PieceSource, SavedPiece
from pretrain.checkpoint.saved_pieces import writers


def test_every_element_is_written_once_by_one_of_its_holders_spread_evenly():
    generator = random.Random(0)
    for _ in range(200):
        world, numel = generator.randint(1, 8), generator.randint(1, 60)
        held = []
        for rank in range(world):  # each rank holds some ranges of two keys; replicas share values
            ranges = []
            for key in ("a", "b"):
                cuts = sorted(generator.sample(range(numel + 1), 2))
                if generator.random() < 0.7 and cuts[1] > cuts[0]:
                    ranges.append((key, cuts[0], cuts[1] - cuts[0]))
            held.append(ranges)
        written = writers(held)
        for key in ("a", "b"):
            count = [0] * numel
            holders = [0] * numel
            for rank, ranges in enumerate(held):
                for (k, start, length), parts in zip(ranges, written[rank]):
                    if k != key:
                        continue
                    for i in range(start, start + length):
                        holders[i] += 1
                    for part_start, part_length in parts:
                        assert start <= part_start and part_start + part_length <= start + length
                        for i in range(part_start, part_start + part_length):
                            count[i] += 1
            assert count == [1 if h else 0 for h in holders]
    # four replicas of 100 elements: 25 each
    assert writers([[("w", 0, 100)]] * 4) == [[[(0, 25)]], [[(25, 25)]], [[(50, 25)]], [[(75, 25)]]]


class _Slices(PieceSource):
    """Pieces cut out of whole tensors as a layout of ``tp`` would hold them, in ranges of random sizes."""

    def __init__(self, wholes: dict, specs: dict, tp: int, generator: random.Random):
        super().__init__()
        self.data = {}
        for name, whole in wholes.items():
            dim, padded_rows = specs[name]
            for rank in range(tp if dim is not None else 1):
                local = _slice(whole, dim, rank, tp, padded_rows)
                geometry = SliceGeometry.of(local.shape, dim, rank, tp,
                                            whole.shape[0] if padded_rows else None)
                flat, start = local.reshape(-1), 0
                while start < flat.numel():
                    length = generator.randint(1, flat.numel() - start)
                    piece = SavedPiece(name, geometry, start, length, (name, rank, start))
                    self.by_name[name].append(piece)
                    self.data[piece.where] = flat[start:start + length].clone()
                    start += length

    def values(self, piece, kind):
        return self.data[piece.where]


def _slice(whole, dim, rank, tp, padded_rows):
    if padded_rows:
        rows = -(-whole.shape[0] // (8 * tp)) * 8 * tp  # this layout's padding
        whole = torch.nn.functional.pad(whole, [0, 0, 0, rows - whole.shape[0]])
    return whole if dim is None else whole.chunk(tp, dim=dim)[rank]


def test_a_recut_by_rectangles_equals_slicing_the_whole():
    generator = random.Random(1)
    torch.manual_seed(0)
    wholes = {"vocab": torch.randn(37, 6), "column": torch.randn(2, 12, 5), "row": torch.randn(4, 24),
              "norm": torch.randn(10), "heads": torch.randn(8, 3)}
    specs = {"vocab": (0, True), "column": (1, False), "row": (1, False), "norm": (None, False),
             "heads": (0, False)}
    for saved_tp in (1, 2, 4):
        source = _Slices(wholes, specs, saved_tp, generator)
        for name, whole in wholes.items():
            assert torch.equal(source.whole(name), whole)
        for held_tp in (1, 2, 4):
            for name, whole in wholes.items():
                dim, padded = specs[name]
                for rank in range(held_tp if dim is not None else 1):
                    expected = _slice(whole, dim, rank, held_tp, padded).reshape(-1)
                    geometry = SliceGeometry.of(_slice(whole, dim, rank, held_tp, padded).shape, dim, rank,
                                                held_tp, whole.shape[0] if padded else None)
                    start = generator.randint(0, expected.numel() - 1)
                    length = generator.randint(1, expected.numel() - start)
                    target = torch.full((length,), float("nan"))
                    source.fill(name, geometry, start, "master", target)
                    assert torch.equal(target, expected[start:start + length]), (name, saved_tp, held_tp)


def test_pieces_cut_into_boxes_of_the_whole_cover_it_once():
    """A Distributed Checkpoint's chunks (``dcp_storage``): every piece of every layout cut into boxes of
    the whole tensor, each box's values a view of the piece's, puts each real element in place once and
    leaves the vocabulary padding out."""
    from pretrain.checkpoint.dcp_storage import _box_values, whole_boxes

    generator = random.Random(2)
    wholes = {"vocab": torch.randn(37, 6), "column": torch.randn(2, 12, 5), "row": torch.randn(4, 24),
              "norm": torch.randn(10), "cube": torch.randn(3, 4, 8, 2)}
    specs = {"vocab": (0, True), "column": (1, False), "row": (1, False), "norm": (None, False),
             "cube": (2, False)}
    for saved_tp in (1, 2, 4):
        source = _Slices(wholes, specs, saved_tp, generator)
        for name, pieces in source.by_name.items():
            built, count = torch.zeros_like(wholes[name]), torch.zeros_like(wholes[name])
            for piece in pieces:
                for offsets, whole, sizes in whole_boxes(piece.geometry, piece.start, piece.length):
                    box = tuple(slice(o, o + s) for o, s in zip(whole, sizes))
                    built[box] = _box_values(source.values(piece, "master"), piece.geometry.shape,
                                             piece.start, offsets, sizes)
                    count[box] += 1
            assert torch.equal(built, wholes[name]) and bool((count == 1).all()), (name, saved_tp)
