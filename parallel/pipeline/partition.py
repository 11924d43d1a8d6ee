"""Which transformer blocks each pipeline stage (and each of its virtual chunks) holds.

A micro-batch visits ``pp * vp`` virtual stages in order. Chunk ``c`` of stage ``p`` is virtual stage
``c * pp + p`` (Megatron's interleaving): stage 0, 1, ..., pp-1 for chunk 0, then again for chunk 1, and
so on. In a V (``v``: the zbv schedule, two chunks) chunk 0 of stage ``p`` is virtual stage ``p`` and
chunk 1 is ``2 pp - 1 - p``: down the stages and back up, so the last stage passes chunk 0's output to
its own chunk 1 and stage 0 holds both ends. The embedding lives in the first virtual stage; the final
norm, the output layer and the loss in the last.

The blocks are cut into consecutive pieces, one per virtual stage in that order: equal ones, or those of
a ``split`` (the layers of each virtual stage in a micro-batch's path, ``layer_split`` makes them from
the flags). A virtual stage of a split may hold no layer when it holds the embedding or the loss.
"""

from __future__ import annotations


def validate_partition(num_layers: int, pp: int, vp: int = 1,
                       split: list[int] | tuple[int, ...] | None = None) -> None:
    """Raise ValueError naming the flags when the blocks cannot be cut as asked."""
    if split is not None:
        stages = pp * vp
        if len(split) != stages or sum(split) != num_layers or min(split) < 0:
            raise ValueError(f"the layers per virtual stage {list(split)} must be {stages} counts "
                             f"(--pipeline-model-parallel-size {pp} x {vp} chunks) summing to --num-layers "
                             f"{num_layers}")
        empty = [index for index, count in enumerate(split) if count == 0 and 0 < index < stages - 1]
        if empty:
            raise ValueError(f"virtual stage {empty[0]} of {stages} would hold no layer, embedding or loss: "
                             "give it at least one layer")
        return
    if pp > num_layers:
        raise ValueError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers "
                         f"{num_layers}: every "
                         f"stage needs at least one layer")
    if num_layers % (pp * vp):
        raise ValueError(f"--num-layers {num_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp} x "
                         f"--virtual-pipeline-size {vp} = {pp * vp}: choose sizes whose product divides it, "
                         "or split them unevenly (--decoder-first-pipeline-num-layers, "
                         "--pipeline-model-parallel-layout)")


def virtual_stage(stage: int, chunk: int, pp: int, v: bool = False) -> int:
    """The place of chunk ``chunk`` of pipeline rank ``stage`` in a micro-batch's path."""
    return 2 * pp - 1 - stage if v and chunk == 1 else chunk * pp + stage


def stage_of(virtual: int, pp: int, v: bool = False) -> int:
    """The pipeline rank that holds virtual stage ``virtual``."""
    return 2 * pp - 1 - virtual if v and virtual >= pp else virtual % pp


def chunk_layers(num_layers: int, pp: int, stage: int, chunk: int = 0, vp: int = 1,
                 split: list[int] | tuple[int, ...] | None = None, v: bool = False) -> list[int]:
    """Global indices of the blocks in chunk ``chunk`` of stage ``stage``."""
    validate_partition(num_layers, pp, vp, split)
    virtual = virtual_stage(stage, chunk, pp, v)
    if split is not None:
        start = sum(split[:virtual])
        return list(range(start, start + split[virtual]))
    size = num_layers // (pp * vp)
    return list(range(virtual * size, (virtual + 1) * size))


def rank_layer_counts(split: list[int] | tuple[int, ...], pp: int, v: bool = False) -> list[int]:
    """The layers each pipeline rank holds over its chunks, for a ``split`` of ``pp x vp`` virtual stages."""
    counts = [0] * pp
    for virtual, count in enumerate(split):
        counts[stage_of(virtual, pp, v)] += count
    return counts
