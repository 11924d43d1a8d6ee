"""The layers of each virtual pipeline stage, made from the ways Megatron-LM names an uneven cut.

Each function returns a split for ``partition`` (layer counts per virtual stage in a micro-batch's path,
``pp x vp`` of them) or raises ValueError naming the flag and what would work:

- ``per_rank_split``: given counts per pipeline rank (``--pipeline-layers-per-stage``,
  ``--decoder-first/last-pipeline-num-layers``), each rank's count cut evenly over its ``vp`` chunks;
- ``accounted_split``: ``--account-for-embedding-in-pipeline-split`` /
  ``--account-for-loss-in-pipeline-split`` count the embedding (the loss) as one more layer of the first
  (last) virtual stage, and the rest is even;
- ``SplitRequest``: whichever of them a run gave, made into the split of a layout (pretrain's and the
  planner's);
- ``layout_split``: ``--pipeline-model-parallel-layout``, Megatron's string: one group per virtual stage
  in path order, separated by ``|``, of ``E`` (the embedding), ``t`` (a transformer layer) and ``L`` (the
  loss), ``x*n`` and ``(...)*n`` repeating, commas ignored; e.g. ``Et*3|(tt|)*6tL`` for 16 layers over 8
  virtual stages. Multi-token prediction (``m``) is not built here.

What the strings hold is read without evaluating anything, and a repeat that would grow one past a
million characters is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parallel.pipeline.partition import validate_partition, virtual_stage

_LONGEST_LAYOUT = 1_000_000
_REPEATS = (re.compile(r"\(([^()]*)\)\*(\d{1,7})"), re.compile(r"([^()*])\*(\d{1,7})"))


def per_rank_split(num_layers: int, pp: int, vp: int, counts: list[int], flag: str,
                   v: bool = False) -> tuple[int, ...]:
    """``counts`` layers on each pipeline rank, each cut into its ``vp`` chunks evenly (``v``: in a V)."""
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"{flag}: layers per stage {list(counts)} must be {pp} positive counts summing to "
                         f"--num-layers {num_layers}")
    uneven = [count for count in counts if count % vp]
    if uneven:
        raise ValueError(f"{flag}: a stage of {uneven[0]} layers does not cut into its {vp} virtual "
                         "chunks evenly: give counts divisible by the chunks, or a "
                         "--pipeline-model-parallel-layout")
    split = [0] * (pp * vp)
    for stage, count in enumerate(counts):
        for chunk in range(vp):
            split[virtual_stage(stage, chunk, pp, v)] = count // vp
    return tuple(split)


def first_last_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's ``--decoder-first/last-pipeline-num-layers``: the given first / last stage counts, the
    other stages the rest evenly."""
    given = first_last_flags(first, last)
    fixed = [count for count in (first, last) if count is not None]
    middle, rest = pp - len(fixed), num_layers - sum(fixed)
    if pp < 2:
        raise ValueError(f"{given} sets the first or last pipeline stage's layers: it needs "
                         "--pipeline-model-parallel-size >= 2")
    if any(count < 1 for count in fixed):
        raise ValueError(f"{given}: every stage holds at least one layer")
    if rest < middle:
        raise ValueError(f"{given}: leaves {rest} of --num-layers {num_layers} for the other {middle} "
                         "stage(s), which hold at least one each")
    if (middle and rest % middle) or (not middle and rest):  # rest >= middle >= 0 from here
        room = (f"the other {middle} of {pp} stages cannot split the remaining {rest} layers evenly"
                if middle else f"the two stages hold {sum(fixed)} layers")
        raise ValueError(f"{given}: {room} (--num-layers {num_layers})")
    even = rest // middle if middle else 0
    return [first if first is not None else even] + [even] * (pp - 2) + [last if last is not None else even]


def first_last_flags(first: int | None, last: int | None) -> str:
    """Megatron's first / last stage flags as given, for a message."""
    return " / ".join(f"--decoder-{end}-pipeline-num-layers {count}"
                      for end, count in (("first", first), ("last", last)) if count is not None)


def accounted_split(num_layers: int, pp: int, vp: int, embedding: bool, loss: bool) -> tuple[int, ...]:
    """Megatron's account-for flags: ``num_layers`` plus the embedding and / or the loss as layers, cut
    evenly over the ``pp x vp`` virtual stages; the first (last) holds one layer fewer."""
    flags = " and ".join(name for name, on in (("--account-for-embedding-in-pipeline-split", embedding),
                                               ("--account-for-loss-in-pipeline-split", loss)) if on)
    units, stages = num_layers + embedding + loss, pp * vp
    if units % stages:
        raise ValueError(f"{flags}: --num-layers {num_layers} + {int(embedding) + int(loss)} = {units} is "
                         f"not divisible by --pipeline-model-parallel-size {pp} x {vp} chunks: choose sizes "
                         "that divide it, or a --pipeline-model-parallel-layout")
    split = [units // stages] * stages
    split[0] -= embedding
    split[-1] -= loss
    validate_partition(num_layers, pp, vp, split)
    return tuple(split)


def layout_split(layout: str, pp: int, num_layers: int) -> tuple[tuple[int, ...], int]:
    """(the split, the chunks per stage) of a ``--pipeline-model-parallel-layout`` string."""
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    text = layout.replace(",", "").replace(" ", "")
    for pattern in _REPEATS:
        while True:
            match = pattern.search(text)
            if match is None:
                break
            grown = len(text) + len(match.group(1)) * (int(match.group(2)) - 1)
            if grown > _LONGEST_LAYOUT:
                raise ValueError(f"{flag}: its repeats make more than {_LONGEST_LAYOUT:,} characters")
            text = text[:match.start()] + match.group(1) * int(match.group(2)) + text[match.end():]
    stray = sorted(set(text) - set("EtL|"))
    if "m" in stray:
        raise ValueError(f"{flag}: multi-token prediction layers (m) are not built here: drop them")
    if stray:
        raise ValueError(f"{flag}: {''.join(stray)!r} is not a layer: use E (embedding), t (transformer "
                         "layer) and L (loss), | between virtual stages, x*n or (...)*n to repeat")
    stages = text.split("|")
    if len(stages) % pp:
        raise ValueError(f"{flag}: its {len(stages)} virtual stages do not divide over "
                         f"--pipeline-model-parallel-size {pp}")
    if text.count("E") != 1 or "E" not in stages[0] or text.count("L") != 1 or "L" not in stages[-1]:
        raise ValueError(f"{flag}: the embedding (E) must be in the first virtual stage and the loss (L) in "
                         "the last, once each")
    split = tuple(stage.count("t") for stage in stages)
    if sum(split) != num_layers:
        raise ValueError(f"{flag}: it places {sum(split)} transformer layers (t), --num-layers is "
                         f"{num_layers}")
    validate_partition(num_layers, pp, len(stages) // pp, split)
    return split, len(stages) // pp


@dataclass(frozen=True)
class SplitRequest:
    """The flags a run gave to cut its layers unevenly (none given: even). A value; ``split`` makes the
    layers per virtual stage for a pipeline of ``pp`` stages of ``vp`` chunks, or raises ValueError."""

    layout: str | None = None  # --pipeline-model-parallel-layout
    per_stage: tuple[int, ...] | None = None  # --pipeline-layers-per-stage
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    embedding: bool = False  # --account-for-embedding-in-pipeline-split
    loss: bool = False  # --account-for-loss-in-pipeline-split

    def given(self) -> list[str]:
        """The ways given; more than one is refused (``check``)."""
        return [name for name, on in (("--pipeline-model-parallel-layout", self.layout),
                                      ("--pipeline-layers-per-stage", self.per_stage is not None),
                                      ("--decoder-first/last-pipeline-num-layers",
                                       self.first is not None or self.last is not None),
                                      ("--account-for-embedding/loss-in-pipeline-split",
                                       self.embedding or self.loss)) if on]

    def check(self) -> None:
        if len(self.given()) > 1:
            raise ValueError(f"{' and '.join(self.given())} both cut the layers over the pipeline stages: "
                             "give one")

    def chunks(self, pp: int, num_layers: int) -> int | None:
        """The chunks per stage a layout string implies (None without one)."""
        return layout_split(self.layout, pp, num_layers)[1] if self.layout else None

    def split(self, num_layers: int, pp: int, vp: int = 1, v: bool = False) -> tuple[int, ...] | None:
        """The layers of each virtual stage, or None for the even cut."""
        self.check()
        if self.layout:
            split, chunks = layout_split(self.layout, pp, num_layers)
            if chunks != vp:
                raise ValueError(f"--pipeline-model-parallel-layout has {chunks} virtual stage(s) per "
                                 f"pipeline stage, the schedule runs {vp} (--virtual-pipeline-size; zbv runs "
                                 "2): make them agree")
            return split
        if self.per_stage is not None:
            if vp > 1 and len(self.per_stage) == pp * vp:  # one count per virtual stage, in path order
                validate_partition(num_layers, pp, vp, self.per_stage)
                return tuple(self.per_stage)
            return per_rank_split(num_layers, pp, vp, list(self.per_stage), "--pipeline-layers-per-stage", v)
        if self.first is not None or self.last is not None:
            counts = first_last_counts(num_layers, pp, self.first, self.last)
            return per_rank_split(num_layers, pp, vp, counts, first_last_flags(self.first, self.last), v)
        if self.embedding or self.loss:
            return accounted_split(num_layers, pp, vp, self.embedding, self.loss)
        return None
