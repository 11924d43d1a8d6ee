"""The layer registry: each entry of a model's layer list (a symbol of ``--hybrid-layer-pattern``, or a
GPT block ``*-`` / ``*E``) -> the kind of layer it is and how to build it.

Models build their layers here, and what counts, prices or names layers (``models.counting``, the
planner, interop) or checks a run (``refusal``, ``recomputable_modules``) asks the kind of each entry
rather than branching on symbols itself. A symbol this build does not construct has a ``refusal``: the
one line a run that asks for it stops with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from models.config import GPTConfig
from models.layers.block import TransformerBlock
from models.layers.residual import AttentionLayer, MLPLayer
from models.gdn.layer import GatedDeltaLayer
from models.kda.layer import KimiDeltaLayer
from models.mamba.config import CONV_KERNEL
from models.mamba.layer import MambaLayer
from parallel.recompute import RECOMPUTE_MODULES


@dataclass(frozen=True)
class LayerContext:
    """What a layer is built with besides its index: the model's config, the tensor-parallel group, the
    seed its weights are drawn from, sequence parallelism, the dropout stream, the expert groups, the
    load balancing of the rank's MoE layers and the context-parallel group."""

    config: GPTConfig
    tp: object  # parallel.comm.AxisGroup
    seed: int
    sequence_parallel: bool
    rng: object  # parallel.tensor.random.RNGTracker
    experts: object = None  # parallel.experts.ExpertGroups
    balancing: object = None  # models.moe.balancing.LoadBalancing
    context: object = None  # parallel.context.ContextParallel, where cp > 1


def _no_values(config: GPTConfig) -> float:
    return 0


def attention_flops(config: GPTConfig) -> float:
    """An attention layer's forward FLOPs per token beyond its weights: the scores and the weighted sum over
    the whole sequence (2 s a (d_qk + d_v); causal halves it, but Megatron and the MFU convention count it
    whole)."""
    return 2 * config.seq_length * config.num_attention_heads * (config.query_key_channels
                                                                 + config.value_channels)


def attention_cache_values(config: GPTConfig) -> float:
    """Values one token leaves in an attention layer's inference cache: with latent attention its key/value
    latent and the shared rotary key (DeepSeek's cache), else each key/value group's key and value."""
    return (config.kv_lora_rank + config.qk_pos_emb_head_dim if config.multi_latent_attention
            else 2 * config.query_groups * config.head_dim)


def mamba_flops(config: GPTConfig) -> float:
    """A Mamba-2 layer's forward FLOPs per token beyond its weights: the convolution (2 K per channel) and
    the recurrence (per head: the decay and the input's outer product into the P x N state, their sum, and
    the output's product with C: 5 P N), whatever the sequence length; the state is fixed, so it leaves no
    per-token cache."""
    return 2 * CONV_KERNEL * config.mamba_conv_channels + 5 * config.mamba_inner * config.mamba_state_dim


def gated_delta_flops(config: GPTConfig) -> float:
    """A gated delta net layer's forward FLOPs per token beyond its weights: the convolution (2 K per
    channel) and the delta rule (per value head, on its dk x dv state: the decay, the read S^T k, the
    write's outer product and the output S^T q: 7 dk dv), whatever the sequence length; its state is
    fixed, so it leaves no per-token cache."""
    return (2 * config.linear_conv_kernel_dim * config.gdn_conv_channels
            + 7 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim)


def kimi_delta_flops(config: GPTConfig) -> float:
    """A Kimi delta attention layer's forward FLOPs per token beyond its weights: the convolution over q,
    k, v and the rule as a gated delta net's (7 d d per head: its decay per channel scales the state as
    the scalar one does)."""
    return (2 * config.linear_conv_kernel_dim * config.kda_conv_channels
            + 7 * config.linear_num_value_heads * config.linear_value_head_dim ** 2)


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer: its entry, Megatron's name for it, the --recompute-modules names it has, and
    ``build(context, layer)`` -> the module, or ``refusal`` where this build has none; what it costs
    besides its weights' products (``mixing_flops`` per token, forward) and the values a token leaves in
    its inference cache (``cache_values``)."""

    entry: str
    name: str
    build: Callable[[LayerContext, int], nn.Module] | None = None
    refusal: str | None = None
    recompute_modules: tuple[str, ...] = ()
    experts: bool = False  # a mixture of experts (its parameters are expert-parallel)
    mixing_flops: Callable[[GPTConfig], float] = _no_values
    cache_values: Callable[[GPTConfig], float] = _no_values


def _gated_delta(context: LayerContext, layer: int) -> nn.Module:
    c = context
    return GatedDeltaLayer(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng, c.context)


def _kimi_delta(context: LayerContext, layer: int) -> nn.Module:
    c = context
    return KimiDeltaLayer(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng, c.context)


def _attention(context: LayerContext, layer: int) -> nn.Module:
    c = context
    return AttentionLayer(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng)


def _mlp(moe: bool):
    def build(context: LayerContext, layer: int) -> nn.Module:
        c = context
        return MLPLayer(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng, c.experts, c.balancing,
                        moe)
    return build


def _block(context: LayerContext, layer: int) -> nn.Module:
    c = context
    return TransformerBlock(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng, c.experts, c.balancing)


def _mamba(context: LayerContext, layer: int) -> nn.Module:
    c = context
    return MambaLayer(c.config, layer, c.tp, c.seed, c.sequence_parallel, c.rng, c.context)


_ATTENTION_MODULES = ("core_attn", "layernorm")
_ATTENTION = {"mixing_flops": attention_flops, "cache_values": attention_cache_values}
_MOE_MODULES = ("moe", "moe_act", "shared_experts", "layernorm")
KINDS: dict[str, LayerKind] = {kind.entry: kind for kind in (
    LayerKind("M", "mamba", _mamba, recompute_modules=("mamba", "layernorm"), mixing_flops=mamba_flops),
    LayerKind("G", "gated delta net", _gated_delta, recompute_modules=("layernorm",),
              mixing_flops=gated_delta_flops),
    LayerKind("K", "kimi delta attention", _kimi_delta, recompute_modules=("layernorm",),
              mixing_flops=kimi_delta_flops),
    LayerKind("*", "attention", _attention, recompute_modules=_ATTENTION_MODULES, **_ATTENTION),
    LayerKind("+", "latent attention", _attention, recompute_modules=_ATTENTION_MODULES + ("mla_up_proj",),
              **_ATTENTION),
    LayerKind("D", "DeepSeek sparse attention",
              refusal="DeepSeek sparse attention (its indexer) is not built: use + (latent attention)"),
    LayerKind("-", "mlp", _mlp(False), recompute_modules=("mlp", "layernorm")),
    LayerKind("E", "moe", _mlp(True), recompute_modules=_MOE_MODULES, experts=True),
    LayerKind("*-", "transformer", _block, recompute_modules=_ATTENTION_MODULES + ("mlp",), **_ATTENTION),
    LayerKind("*E", "transformer", _block, recompute_modules=_ATTENTION_MODULES + _MOE_MODULES, experts=True,
              **_ATTENTION),
    LayerKind("+-", "transformer", _block, recompute_modules=_ATTENTION_MODULES + ("mla_up_proj", "mlp"),
              **_ATTENTION),
    LayerKind("+E", "transformer", _block,
              recompute_modules=_ATTENTION_MODULES + ("mla_up_proj",) + _MOE_MODULES, experts=True,
              **_ATTENTION),
)}


def kind_of(entry: str) -> LayerKind:
    """The kind of a layer-list entry (KeyError for one no model makes)."""
    return KINDS[entry]


def refusal(entries) -> str | None:
    """The first refusal among ``entries`` (a symbol and why), or None where all of them are built."""
    for entry in dict.fromkeys(entries):
        kind = kind_of(entry)
        if kind.refusal is not None:
            return f"{entry!r} ({kind.name}): {kind.refusal}"
    return None


def build_layer(entry: str, context: LayerContext, layer: int) -> nn.Module:
    """The module of global layer ``layer``, whose entry is ``entry``."""
    kind = kind_of(entry)
    if kind.build is None:
        raise ValueError(refusal([entry]))
    return kind.build(context, layer)


def recomputable_modules(config: GPTConfig) -> list[str]:
    """The --recompute-modules names of the parts a model of ``config`` has (Megatron's names)."""
    have = {name for entry in config.layer_types() for name in kind_of(entry).recompute_modules}
    if config.moe_shared_expert_intermediate_size is None:
        have.discard("shared_experts")
    return [name for name in RECOMPUTE_MODULES if name in have]


def check_buildable(config: GPTConfig) -> None:
    """ValueError naming the flag and symbol where a pattern asks for a layer this build has none of."""
    pattern = config.parsed_pattern()
    refused = pattern is not None and refusal(pattern.layers + pattern.mtp)
    if refused:
        raise ValueError(f"--hybrid-layer-pattern {pattern.text!r}: {refused}")
