"""Cut the GPT into the model chunks of one pipeline stage."""

from __future__ import annotations

from torch import nn

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.comm import AxisGroup
from parallel.pipeline.partition import chunk_layers
from parallel.process_groups import ParallelGroups
from parallel.tensor.random import RNGTracker, model_parallel_tracker


def stage_chunks(config: GPTConfig, tp: AxisGroup, pp: int, stage: int, *, seed: int, vp: int = 1,
                 sequence_parallel: bool = False, layers_per_stage: list[int] | None = None,
                 rng: RNGTracker | None = None) -> nn.ModuleList:
    """The ``vp`` model chunks of pipeline stage ``stage``: chunk c holds the blocks of piece c * pp + stage;
    the embedding is in chunk 0 of stage 0, the output layer and loss in the last chunk of the last stage."""
    return nn.ModuleList(
        GPTModel(config, tp, seed=seed, sequence_parallel=sequence_parallel, rng=rng,
                 layer_indices=chunk_layers(config.num_layers, pp, stage, chunk, vp, layers_per_stage),
                 pre_process=stage == 0 and chunk == 0, post_process=stage == pp - 1 and chunk == vp - 1)
        for chunk in range(vp))


def build_pipeline_stage(config: GPTConfig, groups: ParallelGroups, *, seed: int, vp: int = 1,
                sequence_parallel: bool = False, layers_per_stage: list[int] | None = None) -> nn.ModuleList:
    """This rank's model chunks, with one dropout stream for all chunks of the stage."""
    stage = groups.pp_rank
    return stage_chunks(config, groups.tp, groups.topology.pp, stage, seed=seed, vp=vp,
                        sequence_parallel=sequence_parallel, layers_per_stage=layers_per_stage,
                        rng=model_parallel_tracker(seed, groups.tp_rank, stage))
