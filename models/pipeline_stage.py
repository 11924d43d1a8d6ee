"""Cut the GPT into the model chunks of one pipeline stage."""

from __future__ import annotations

from torch import nn

from models.config import GPTConfig
from models.gpt import GPTModel
from models.moe.balancing import LoadBalancing
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.experts import ExpertGroups
from parallel.pipeline.partition import chunk_layers, virtual_stage
from parallel.process_groups import ParallelGroups
from parallel.tensor.random import RNGTracker, model_parallel_tracker


def stage_chunks(config: GPTConfig, tp: AxisGroup, pp: int, stage: int, *, seed: int, vp: int = 1,
                 sequence_parallel: bool = False, split: list[int] | None = None,
                 rng: RNGTracker | None = None, context: ContextParallel | None = None,
                 experts: ExpertGroups | None = None, v: bool = False) -> nn.ModuleList:
    """The ``vp`` model chunks of pipeline stage ``stage``: chunk c holds the blocks of its virtual stage
    (``parallel.pipeline.partition``; ``v``: placed in a V); the embedding is in the first virtual stage, the
    output layer and loss in the last; the chunks' MoE layers share one ``LoadBalancing``."""
    balancing = LoadBalancing.for_model(config) if config.num_experts else None
    last = pp * vp - 1
    return nn.ModuleList(
        GPTModel(config, tp, seed=seed, sequence_parallel=sequence_parallel, rng=rng, context=context,
                 experts=experts, balancing=balancing,
                 layer_indices=chunk_layers(config.num_layers, pp, stage, chunk, vp, split, v),
                 pre_process=virtual_stage(stage, chunk, pp, v) == 0,
                 post_process=virtual_stage(stage, chunk, pp, v) == last)
        for chunk in range(vp))


def build_pipeline_stage(config: GPTConfig, groups: ParallelGroups, *, seed: int, vp: int = 1,
                         sequence_parallel: bool = False, split: list[int] | None = None,
                         cp_comm_type: tuple[str, ...] = ("p2p",)) -> nn.ModuleList:
    """This rank's model chunks, with one dropout stream for all chunks of the stage (and of the cp rank:
    each holds other tokens); attention over the cp group by ``cp_comm_type`` (one, or one per layer)."""
    stage = groups.pp_rank
    context = ContextParallel(groups.cp, tuple(cp_comm_type)) if groups.cp.size > 1 else None
    return stage_chunks(config, groups.tp, groups.topology.pp, stage, seed=seed, vp=vp,
                        sequence_parallel=sequence_parallel, split=split,
                        rng=model_parallel_tracker(seed, groups.tp_rank, stage, groups.cp_rank),
                        context=context, experts=ExpertGroups.of(groups), v=groups.topology.pipeline_v)
