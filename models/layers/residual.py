"""A layer of the residual stream: x + dropout(sublayer(norm(x))) (or, listed in --post-norm-layers, x +
dropout(norm(sublayer(x)))), and the two kinds a pattern's
attention (``*``, ``+``) and MLP (``-``, ``E``) symbols build.

``ResidualLayer`` owns what every layer kind shares: its global index, the residual dropout (drawn from
the default stream, where tp ranks hold replicas, or from the per-tp-rank stream under sequence
parallelism, where each holds other tokens) and the pre-norm runner of ``--recompute-modules layernorm``.
A subclass names its norm and sublayer after what they are (``attention_norm`` / ``attention``,
``mlp_norm`` / ``mlp``, ``mamba_norm`` / ``mamba``), so weights keep one name in every model.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention import LayerInputs, SelfAttention
from models.config import GPTConfig
from models.latent.attention import LatentAttention
from models.mlp import MLP
from models.moe.balancing import LoadBalancing
from models.moe.layer import MoELayer
from models.norms import build_norm
from parallel.comm import AxisGroup, compile_boundary
from parallel.experts import ExpertGroups
from parallel.tensor.random import RNGTracker


def dropout(p: float) -> nn.Module:
    """Dropout, or nothing at p = 0 (so no mask is made or kept for backward)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class ResidualLayer(nn.Module):
    """The residual plumbing of one layer (global index ``layer``); a subclass holds the norm(s) and
    sublayer(s) and calls ``_branch``. It never owns weights of its own and never communicates."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, sequence_parallel: bool,
                 rng: RNGTracker):
        super().__init__()
        self.layer, self.rng = layer, rng
        self.dropout = dropout(config.hidden_dropout)
        self.fork_for_dropout = sequence_parallel and tp.size > 1 and config.hidden_dropout > 0
        self.norm_runner = None  # how a pre-norm and its sublayer run when the norm is recomputed
        self.post_norm = layer in (config.post_norm_layers or ())  # x + norm(f(x)), not x + f(norm(x))

    def attention_windows(self) -> set:
        """The attention windows (keys a query sees; None: the whole past) of this layer's attention."""
        return set()

    def recompute_selectively(self, modules: tuple[str, ...], runner, dropped) -> None:
        """Selective recompute of the parts ``modules`` names (Megatron's --recompute-modules) that this
        layer has: ``runner(compute, *inputs)`` recomputes a part from its inputs, ``dropped`` (a
        ``parallel.recompute.DroppedOutput``) drops a cheap function's output and rebuilds it."""
        if "layernorm" in modules:  # each pre-norm's output dropped once its sublayer has run
            self.norm_runner = dropped

    def _normed(self, norm: nn.Module, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.norm_runner is None or isinstance(norm, nn.Identity):
            return sublayer(norm(x))
        normed = self.norm_runner.run(norm, x)
        out = sublayer(normed)
        self.norm_runner.drop(norm, x, normed, out)
        return out

    def _branch(self, x: torch.Tensor, norm: nn.Module, sublayer) -> torch.Tensor:
        """x + dropout(sublayer(norm(x))), or with ``post_norm`` x + dropout(norm(sublayer(x)))."""
        if self.post_norm:
            return x + self._residual_dropout(norm(sublayer(x)))
        return x + self._residual_dropout(self._normed(norm, x, sublayer))

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        return self._dropout_on_own_stream(x) if self.fork_for_dropout else self.dropout(x)

    @compile_boundary  # the per-rank random stream is swapped in around it
    def _dropout_on_own_stream(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng.fork():
            return self.dropout(x)


def recompute_attention(attention: nn.Module, modules: tuple[str, ...], runner) -> None:
    """Install the selective recompute of an attention sublayer's parts (its core, latent up-projection)."""
    if "mla_up_proj" in modules and isinstance(attention, LatentAttention):
        attention.recompute_up_with(runner)
    elif "core_attn" in modules:
        attention.recompute_core_with(runner)


def recompute_mlp(mlp: nn.Module, modules: tuple[str, ...], runner, dropped) -> None:
    """Install the selective recompute of an MLP or MoE sublayer (whole, its experts' activation, its
    shared expert)."""
    if mlp.RECOMPUTE_MODULE in modules:  # "mlp" or "moe"
        mlp.recompute_with(runner)
    elif isinstance(mlp, MoELayer):
        if "moe_act" in modules:
            mlp.experts.recompute_activation_with(dropped)
        if "shared_experts" in modules and mlp.shared_experts is not None:
            mlp.shared_experts.recompute_with(runner)


def build_attention(config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                    rng: RNGTracker) -> nn.Module:
    """The attention sublayer the configuration asks for: latent (--multi-latent-attention) or not."""
    kind = LatentAttention if config.multi_latent_attention else SelfAttention
    return kind(config, layer, tp, seed, sequence_parallel, rng)


def build_mlp(config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
              experts: ExpertGroups | None, balancing: LoadBalancing | None, moe: bool) -> nn.Module:
    """A dense MLP, or (``moe``) a mixture of experts over this rank's ``experts``."""
    if not moe:
        return MLP(config, layer, tp, seed, sequence_parallel)
    return MoELayer(config, layer, tp, seed, sequence_parallel, experts or ExpertGroups.detached(),
                    balancing if balancing is not None else LoadBalancing.for_model(config))


class AttentionLayer(ResidualLayer):
    """x + attention(attention_norm(x)): a pattern's ``*`` (or ``+``, latent) layer."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        self.attention_norm = build_norm(config, config.hidden_size, sequence_parallel)
        self.attention = build_attention(config, layer, tp, seed, sequence_parallel, rng)

    def attention_windows(self) -> set:
        return {self.attention.scores.window}

    def recompute_selectively(self, modules: tuple[str, ...], runner, dropped) -> None:
        super().recompute_selectively(modules, runner, dropped)
        recompute_attention(self.attention, modules, runner)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        return self._branch(x, self.attention_norm, lambda normed: self.attention(normed, inputs))


class MLPLayer(ResidualLayer):
    """x + mlp(mlp_norm(x)): a pattern's ``-`` (dense) or ``E`` (mixture of experts) layer."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker, experts: ExpertGroups | None, balancing: LoadBalancing | None, moe: bool):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        self.mlp_norm = build_norm(config, config.hidden_size, sequence_parallel)
        self.mlp = build_mlp(config, layer, tp, seed, sequence_parallel, experts, balancing, moe)

    def recompute_selectively(self, modules: tuple[str, ...], runner, dropped) -> None:
        super().recompute_selectively(modules, runner, dropped)
        recompute_mlp(self.mlp, modules, runner, dropped)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        return self._branch(x, self.mlp_norm, self.mlp)
