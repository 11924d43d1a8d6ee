"""Which transformer blocks each pipeline stage (and each of its virtual chunks) holds.

The ``num_layers`` blocks are cut into ``pp * vp`` equal consecutive pieces, the virtual stages a
micro-batch visits in order. Piece ``c * pp + p`` goes to chunk ``c`` of stage ``p`` (Megatron's
interleaving), so a micro-batch visits stage 0, 1, ..., pp-1 for chunk 0, then again for chunk 1, and so
on. In a V (``v``: the zbv schedule, two chunks) chunk 0 of stage ``p`` holds piece ``p`` and chunk 1
piece ``2 pp - 1 - p``: down the stages and back up, so the last stage passes chunk 0's output to its own
chunk 1 and stage 0 holds both ends. The embedding lives in the first virtual stage; the final norm, the
output layer and the loss in the last.
"""

from __future__ import annotations


def validate_partition(num_layers: int, pp: int, vp: int = 1,
                       layers_per_stage: list[int] | None = None) -> None:
    """Raise ValueError naming the flags when the blocks cannot be split as asked."""
    if pp > num_layers:
        raise ValueError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers "
                         f"{num_layers}: every "
                         f"stage needs at least one layer")
    if layers_per_stage is not None:
        if vp != 1:
            raise ValueError("an explicit split of layers per stage cannot be combined with "
                             "--virtual-pipeline-size")
        if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
            raise ValueError(f"layers per stage {layers_per_stage} must be {pp} positive counts summing to "
                             f"--num-layers {num_layers}")
        return
    if num_layers % (pp * vp):
        raise ValueError(f"--num-layers {num_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp} x "
                         f"--virtual-pipeline-size {vp} = {pp * vp}: choose sizes whose product divides it")


def virtual_stage(stage: int, chunk: int, pp: int, v: bool = False) -> int:
    """The place of chunk ``chunk`` of pipeline rank ``stage`` in a micro-batch's path."""
    return 2 * pp - 1 - stage if v and chunk == 1 else chunk * pp + stage


def stage_of(virtual: int, pp: int, v: bool = False) -> int:
    """The pipeline rank that holds virtual stage ``virtual``."""
    return 2 * pp - 1 - virtual if v and virtual >= pp else virtual % pp


def chunk_layers(num_layers: int, pp: int, stage: int, chunk: int = 0, vp: int = 1,
                 layers_per_stage: list[int] | None = None, v: bool = False) -> list[int]:
    """Global indices of the blocks in chunk ``chunk`` of stage ``stage``."""
    validate_partition(num_layers, pp, vp, layers_per_stage)
    if layers_per_stage is not None:
        start = sum(layers_per_stage[:stage])
        return list(range(start, start + layers_per_stage[stage]))
    size = num_layers // (pp * vp)
    start = virtual_stage(stage, chunk, pp, v) * size
    return list(range(start, start + size))
