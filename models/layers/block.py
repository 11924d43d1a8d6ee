"""The GPT's transformer block: attention and an MLP (or experts) as one layer, the entry ``*-`` / ``*E``
(``+-`` / ``+E`` with latent attention) of a model built without ``--hybrid-layer-pattern``."""

from __future__ import annotations

import torch
from torch import nn

from models.attention import LayerInputs
from models.config import GPTConfig
from models.layers.residual import (ResidualLayer, build_attention, build_mlp, recompute_attention,
                                    recompute_mlp)
from models.moe.balancing import LoadBalancing
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.experts import ExpertGroups
from parallel.tensor.random import RNGTracker


class TransformerBlock(ResidualLayer):
    """x + attn(norm(x)), then + mlp(norm(.)), with dropout on both residual branches; the norms where
    --norm-placement puts them: before each sublayer (pre: ``attention_norm``, ``mlp_norm``), before and
    after it (sandwich: ``attention_post_norm``, ``mlp_post_norm`` too), or after it only (post). The MLP
    is a mixture of experts where --num-experts / --moe-layer-freq make this layer one."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker, experts: ExpertGroups | None = None,
                 balancing: LoadBalancing | None = None):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        before, after = config.norm_placement != "post", config.norm_placement != "pre"
        h = config.hidden_size
        self.attention_norm = build_norm(config, h, sequence_parallel) if before else nn.Identity()
        self.attention = build_attention(config, layer, tp, seed, sequence_parallel, rng)
        self.attention_post_norm = build_norm(config, h, sequence_parallel) if after else nn.Identity()
        self.mlp_norm = build_norm(config, h, sequence_parallel) if before else nn.Identity()
        self.mlp = build_mlp(config, layer, tp, seed, sequence_parallel, experts, balancing,
                             config.moe_layers_with_depths()[layer])  # (past the model's: the depths')
        self.mlp_post_norm = build_norm(config, h, sequence_parallel) if after else nn.Identity()

    def attention_windows(self) -> set:
        return {self.attention.scores.window}

    def recompute_selectively(self, modules: tuple[str, ...], runner, dropped) -> None:
        """As ``ResidualLayer``'s, for both sublayers; a part recomputed whole takes what it holds along
        (``moe`` its experts, ``mla_up_proj`` the core)."""
        super().recompute_selectively(modules, runner, dropped)
        recompute_attention(self.attention, modules, runner)
        recompute_mlp(self.mlp, modules, runner, dropped)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        attended = self.attention_post_norm(self._normed(self.attention_norm, x,
                                                         lambda normed: self.attention(normed, inputs)))
        x = x + self._residual_dropout(attended)
        return x + self._residual_dropout(self.mlp_post_norm(self._normed(self.mlp_norm, x, self.mlp)))
