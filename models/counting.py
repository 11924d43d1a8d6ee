"""What a GPT holds and costs, counted from the model itself rather than from a second formula.

Every count builds the part in question exactly as training does (``models.pipeline_stage``), on the meta
device: shapes and parallel metadata, no memory and no values. So a new architecture option changes
the counts by construction. Used by the trainer (parameters, FLOPs), the validation (swap-file
sizes) and the memory planner (``launch.tools.planning.plan``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from models.config import GPTConfig
from models.latent.attention import LatentAttention
from models.layers.registry import kind_of
from models.moe.layer import MoELayer
from models.pipeline_stage import stage_chunks
from parallel.comm import DetachedGroup
from parallel.experts import ExpertGroups
from parallel.tensor.layers import ColumnParallelLinear, LinearWeights, RowParallelLinear


def stage_model(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0, vp: int = 1,
                sequence_parallel: bool = False, split: list[int] | None = None,
                experts: tuple[int, int] = (1, 1)) -> nn.ModuleList:
    """Pipeline stage ``stage``'s model chunks as tensor-parallel rank 0 of ``tp`` holds them, on the meta
    device (every tp rank holds the same shapes); ``experts``: (ep, etp), its MoE layers' expert layout (a
    rank holds E / ep experts, each 1 / etp of its width)."""
    layers = tuple(split) if split else None
    return _stage_model(frozen_config(config), tp, pp, stage, vp, sequence_parallel, layers, experts)


def stage_parameters(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                     sequence_parallel: bool = False, split: list[int] | None = None,
                     experts: tuple[int, int] = (1, 1), v: bool = False,
                     vp: int | None = None) -> tuple[nn.Parameter, ...]:
    """The parameters of ``stage_model(config, tp, pp, stage, ...)`` (``vp`` chunks; ``v``: two chunks
    placed in a V, zbv's), listed once per model and layout (a planner prices thousands of layouts; walking
    the module tree each time was most of its work)."""
    layers = tuple(split) if split else None
    return _stage_parameters(frozen_config(config), tp, pp, stage, sequence_parallel, layers, experts, v,
                             vp or (2 if v else 1))


def stage_named_parameters(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                           sequence_parallel: bool = False, split: list[int] | None = None,
                           experts: tuple[int, int] = (1, 1), v: bool = False,
                           vp: int | None = None) -> tuple[tuple[str, nn.Parameter], ...]:
    """``stage_parameters`` with each one's name in its chunk (which optimizer steps a parameter follows
    from its name: Muon's matrices are the layers')."""
    layers = tuple(split) if split else None
    return _stage_named_parameters(frozen_config(config), tp, pp, stage, sequence_parallel, layers, experts,
                                   v, vp or (2 if v else 1))


@functools.lru_cache(maxsize=64)
def _stage_named_parameters(frozen: tuple, tp: int, pp: int, stage: int, sequence_parallel: bool,
                            split: tuple[int, ...] | None, experts: tuple[int, int], v: bool,
                            vp: int) -> tuple[tuple[str, nn.Parameter], ...]:
    return tuple(_stage_model(frozen, tp, pp, stage, vp, sequence_parallel, split, experts, v)
                 .named_parameters())


@functools.lru_cache(maxsize=256)
def _stage_parameters(frozen: tuple, tp: int, pp: int, stage: int, sequence_parallel: bool,
                      split: tuple[int, ...] | None, experts: tuple[int, int], v: bool,
                      vp: int) -> tuple[nn.Parameter, ...]:
    return tuple(_stage_model(frozen, tp, pp, stage, vp, sequence_parallel, split, experts, v).parameters())


_FROZEN: dict[int, tuple[dict, tuple]] = {}  # id(config) -> (its fields when frozen, the key)


def frozen_config(config: GPTConfig) -> tuple:
    """The config as a hashable key (list fields as tuples), remembered per config object while its fields
    stay the same (a planner asks it of one config for every layout)."""
    known = _FROZEN.get(id(config))
    if known is not None and known[0] == vars(config):  # the copies of list fields compare by value
        return known[1]
    fields = {name: list(value) if isinstance(value, list) else value for name, value in vars(config).items()}
    frozen = tuple(sorted((name, tuple(value) if isinstance(value, list) else value)
                          for name, value in fields.items()))
    if len(_FROZEN) > 64:
        _FROZEN.clear()
    _FROZEN[id(config)] = (fields, frozen)
    return frozen


def thawed_config(frozen: tuple) -> GPTConfig:
    """The config a ``frozen_config`` key was made of."""
    return GPTConfig(**{name: list(value) if isinstance(value, tuple) else value for name, value in frozen})


@functools.lru_cache(maxsize=64)
def _stage_model(frozen: tuple, tp: int, pp: int, stage: int, vp: int, sequence_parallel: bool,
                 split: tuple[int, ...] | None,
                 experts: tuple[int, int] = (1, 1), v: bool = False) -> nn.ModuleList:
    config = thawed_config(frozen)
    with torch.device("meta"):
        return stage_chunks(config, DetachedGroup("tp", tp), pp, stage, seed=0, vp=vp,
                            sequence_parallel=sequence_parallel,
                            split=list(split) if split else None,
                            experts=ExpertGroups.detached(*experts), v=v)


def num_parameters(config: GPTConfig) -> int:
    """Parameters of the whole model: one process holds them all (vocabulary padded as at tp = 1; a tied
    output layer is the embedding, counted once). Kept per model: the planner asks it of every layout."""
    return _num_parameters(frozen_config(config))


@functools.lru_cache(maxsize=64)
def _num_parameters(frozen: tuple) -> int:
    return sum(p.numel() for p in _stage_model(frozen, 1, 1, 0, 1, False, None).parameters())


EMBEDDINGS = ("word_embedding.weight", "position_embedding.weight", "output_layer.weight")


def non_embedding_parameters(config: GPTConfig) -> int:
    """Parameters of the whole model without the token and position embeddings and the output layer
    (Kaplan et al.'s N)."""
    return sum(p.numel() for p, name in stage_model(config)[0].global_parameter_names().items()
               if name not in EMBEDDINGS)


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token: 3 x the forward's (backward costs two forwards), the forward being
    2 FLOPs per weight of every matmul a token passes through (attention, MLP, output layer, as built; in
    a MoE layer the router, its k experts' and the shared expert's) plus each layer's sequence mixing
    (``models.layers.registry``: an attention layer's scores and weighted sum, 2 x 2 x s x (heads x
    head_dim), the full s x s product as Megatron counts it; a Mamba layer's convolution and scan).
    Kept per model: the planner asks it of every layout."""
    return 3 * sum(forward_flops_per_token(config))


def forward_flops_per_token(config: GPTConfig) -> tuple[float, float]:
    """A token's forward FLOPs (``flops_per_token``'s third) as (weight products, sequence mixing):
    backward repeats the weight products twice, once for the inputs' gradients and once for the weights',
    and the mixing part twice for its inputs'."""
    return _forward_flops_per_token(frozen_config(config))


@functools.lru_cache(maxsize=64)
def _forward_flops_per_token(frozen: tuple) -> tuple[float, float]:
    layers, (head, head_mixing) = _forward_flops_parts(frozen)
    return (sum(matmul for matmul, _ in layers) + head,
            sum(attention for _, attention in layers) + head_mixing)


def forward_flops_parts(config: GPTConfig) -> tuple[tuple[tuple[float, float], ...], tuple[float, float]]:
    """``forward_flops_per_token`` by part: (weight products, sequence mixing) of each layer, and the
    same pair for the head: the output layer's products and, with prediction depths, theirs and their
    layers' mixing (a pipeline stage costs what its layers and, last, the head cost)."""
    return _forward_flops_parts(frozen_config(config))


@functools.lru_cache(maxsize=64)
def _forward_flops_parts(frozen: tuple) -> tuple[tuple[tuple[float, float], ...], tuple[float, float]]:
    config = thawed_config(frozen)
    chunk = _stage_model(frozen, 1, 1, 0, 1, False, None)[0]
    layers = [(2.0 * _active_matmuls(block), float(kind_of(entry).mixing_flops(config)))
              for entry, block in zip(config.layer_types(), chunk.layers)]
    output = chunk.word_embedding.weight if chunk.tied else chunk.output_layer.weight
    depths = list(chunk.mtp)  # the prediction depths, with the head on its stage
    head = sum(module.weight.numel() for module in chunk.modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))) \
        - sum(module.weight.numel() for block in [*chunk.layers, *depths] for module in block.modules()
              if isinstance(module, (ColumnParallelLinear, RowParallelLinear)))
    # each depth: eh_proj and its layers' products, the output layer once more, its layers' sequence mixing
    head += sum(_active_matmuls(depth) for depth in depths) + len(depths) * output.numel()
    mixing = len(depths) * sum(float(kind_of(entry).mixing_flops(config))
                               for entry in config.mtp_layer_types())
    return tuple(layers), (2.0 * (head + output.numel()), mixing)


def _active_matmuls(block: nn.Module) -> float:
    """The weights of ``block``'s products a token passes through: its parallel linear layers, latent
    attention's projections, and in a mixture of experts the router, k experts and the shared expert's gate
    (its shared expert's layers are among the linear ones)."""
    matmul = sum(module.weight.numel() for module in block.modules()
                 if isinstance(module, (ColumnParallelLinear, RowParallelLinear)))
    for layer in block.modules():
        if isinstance(layer, MoELayer):
            experts = list(layer.experts.children())
            per_expert = sum(e.fc1.weight.numel() + e.fc2.weight.numel() for e in experts) / len(experts)
            gate = layer.shared_gate.weight.numel() if layer.shared_gate is not None else 0
            matmul += layer.router.weight.numel() + layer.options.topk * per_expert + gate
    return matmul + _latent_matmuls(block)


def _latent_matmuls(model: nn.Module) -> int:
    """The weights of latent attention's projections a token passes through (held as plain weights, not
    parallel linear layers); 0 without latent attention."""
    return sum(linear.weight.numel() for attention in model.modules()
               if isinstance(attention, LatentAttention)
               for linear in attention.children() if isinstance(linear, LinearWeights))


def kv_cache_values_per_token(config: GPTConfig) -> int:
    """Values one token leaves in an inference key/value cache over all layers (each layer kind's, from the
    layer registry: an attention layer's keys and values or latent, none for a Mamba layer)."""
    return int(sum(kind_of(entry).cache_values(config) for entry in config.layer_types()))
