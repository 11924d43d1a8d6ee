"""The build step of a run: process groups, then the model (its fp8 products), then activation recompute,
then compilation, then ZeRO.

Each step is one call, in this order, as ``Trainer`` makes them; a benchmark or check that needs part
of a run calls the same functions. Nothing here trains, saves or logs.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from models.compile import compile_layers
from models.moe.experts import Experts
from models.pipeline_stage import build_pipeline_stage
from parallel import zero
from parallel.buffer_pool import BufferPool
from parallel.param_meta import meta
from parallel.process_groups import ParallelGroups, create_process_groups
from parallel.recompute import RecomputePolicy, apply_recompute
from parallel.tensor.fp8 import Fp8Recipe
from parallel.tensor.layers import use_fp8
from parallel.topology import Topology
from parallel.zero import ConstantLossScaler, DynamicLossScaler, ZeroGroups, ZeroOptions
from pretrain.config.schema import Config
from pretrain.training.param_groups import optimizer_factory, parameter_groups


def zero_options(config: Config) -> ZeroOptions:
    """The ZeRO optimizer's settings from the --zero-*, --offload-* and --clip-grad flags."""
    z = config.zero
    return ZeroOptions(
        stage=z.zero_stage, bucket_size=z.zero_bucket_size, clip_grad=config.optimizer.clip_grad,
        persistence_threshold=z.zero_persistence_threshold, prefetch_budget=z.zero_prefetch_budget,
        offload_optimizer=z.offload_optimizer, offload_param=z.offload_param, nvme_path=z.nvme_path,
        sub_group_size=z.zero_sub_group_size, main_grads_in_fp32=not z.grad_reduce_in_bf16,
        overlap_param_gather=z.overlap_param_gather, quantized_weights=z.zero_quantized_weights,
        quantized_gradients=z.zero_quantized_gradients, hpz_partition_size=z.zero_hpz_partition_size,
        shard_size=z.zero_shard_size)


def compute_dtype(config: Config) -> torch.dtype:
    train = config.training
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


def build_groups(config: Config, topology: Topology) -> ParallelGroups:
    """Every process group of the layout, with the data-parallel partitions ZeRO++ and MiCS need."""
    return create_process_groups(topology, config.parallel.distributed_timeout_s,
                                 dp_partitions=zero.dp_partitions(topology, zero_options(config)))


def build_model(config: Config, groups: ParallelGroups, device: torch.device) -> nn.ModuleList:
    """This rank's pipeline-stage chunks in the compute dtype: on ``device``, or at ZeRO stage 3 on the
    meta device (no rank ever holds the model whole: each unit is materialised and sharded by ZeRO)."""
    sharded, par = config.zero.zero_stage == 3, config.parallel
    with torch.device("meta") if sharded else contextlib.nullcontext():
        model = build_pipeline_stage(config.model, groups, seed=config.training.seed,
                                     vp=par.virtual_pipeline_size or 1,
                                     sequence_parallel=par.sequence_parallel,
                                     split=par.pipeline_layers_per_stage,
                                     cp_comm_type=tuple(par.cp_comm_type))
    return model.to(compute_dtype(config)) if sharded else model.to(device, compute_dtype(config))


def build_fp8(model: nn.ModuleList, config: Config) -> tuple[int, int]:
    """--fp8-format: the transformer layers' linear products in fp8 (``parallel.tensor.fp8``); the embedding
    and the output layer stay in the compute dtype, as Megatron keeps them. Returns (layers in fp8, layers
    whose shape torch cannot multiply in fp8); (0, 0) without the flag."""
    train = config.training
    if train.fp8_format is None:
        return 0, 0
    recipe = Fp8Recipe(train.fp8_format, train.fp8_recipe, train.fp8_emulate)
    counts = [use_fp8(layer, recipe) for chunk in model for layer in chunk.layers]
    return sum(c for c, _ in counts), sum(s for _, s in counts)


def build_recompute(model: nn.ModuleList, config: Config, groups: ParallelGroups,
                    buffer_pool: BufferPool) -> None:
    """Activation recompute as the --recompute-* flags ask, its buffers from ``buffer_pool``."""
    r = config.recompute
    policy = RecomputePolicy(r.recompute_granularity, r.recompute_num_layers, r.recompute_method,
                             r.partition_activations, r.activations_on_cpu, tuple(r.recompute_modules))
    apply_recompute(model, policy, groups.tp, buffer_pool)


def build_compile(model: nn.ModuleList, config: Config) -> None:
    """--compile: each layer and the loss head compiled (``models.compile``), after recompute is installed
    (its runners stay eager around the compiled layers) and before ZeRO (whose hooks stay eager too)."""
    if config.training.compile:
        compile_layers(model, config.training.compile_backend)


def build_optimizer(model: nn.ModuleList, config: Config, groups: ParallelGroups,
                    buffer_pool: BufferPool) -> zero.ZeroOptimizer | zero.ChainedZeroOptimizer:
    """AdamW under ZeRO over the data x context groups; each chunk and transformer block one stage-3 unit.
    With experts, a second one over the expert data-parallel groups holds the expert parameters (each MoE
    layer's experts one stage-3 unit), chained to the first: one loss scale, one norm, one step."""
    train, options = config.training, zero_options(config)
    scaler = (DynamicLossScaler(train.initial_loss_scale, growth_interval=train.loss_scale_window,
                                hysteresis=train.hysteresis, min_scale=train.min_loss_scale)
              if train.fp16 else ConstantLossScaler())
    param_groups = parameter_groups(model, config.optimizer, config.model.mup_width_mult)

    def only(expert: bool) -> list[dict]:
        return [{**group, "params": [p for p in group["params"] if meta(p).expert == expert]}
                for group in param_groups]

    _, optimizer = zero.initialize(model, optimizer_factory(config.optimizer), options,
                                   ZeroGroups.from_parallel_groups(groups, options),
                                   param_groups=only(False), loss_scaler=scaler,
                                   unit_modules=[*model,
                                                 *(block for chunk in model for block in chunk.layers)],
                                   buffer_pool=buffer_pool, backward_parts=list(model))
    if not any(config.model.moe_layers(config.model.num_layers)):
        return optimizer
    # on every rank, with or without experts on its stage: the expert part's norm and overflow are
    # collectives over every stage's expert ranks
    _, expert_optimizer = zero.initialize(model, optimizer_factory(config.optimizer), options,
                                          ZeroGroups.for_experts(groups), param_groups=only(True),
                                          loss_scaler=scaler,
                                          unit_modules=[m for m in model.modules() if isinstance(m, Experts)],
                                          buffer_pool=buffer_pool, backward_parts=list(model))
    return zero.ChainedZeroOptimizer([optimizer, expert_optimizer])
