"""The Mamba-2 layer of a hybrid model (``M`` in ``--hybrid-layer-pattern``): x + mamba(mamba_norm(x))."""

from __future__ import annotations

import torch

from models.attention import LayerInputs
from models.config import GPTConfig
from models.layers.residual import ResidualLayer
from models.mamba.mixer import MambaMixer
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.tensor.random import RNGTracker


class MambaLayer(ResidualLayer):
    """Owns its pre-norm (``mamba_norm``, the model's --normalization) and its ``MambaMixer``; the state
    starts afresh at each document with --reset-attention-mask (the inputs' ``documents``)."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker, context: ContextParallel | None = None):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        self.mamba_norm = build_norm(config, config.hidden_size, sequence_parallel)
        self.mamba = MambaMixer(config, layer, tp, seed, sequence_parallel, context)

    def recompute_selectively(self, modules: tuple[str, ...], runner, dropped) -> None:
        super().recompute_selectively(modules, runner, dropped)
        if MambaMixer.RECOMPUTE_MODULE in modules:
            self.mamba.recompute_with(runner)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        return self._branch(x, self.mamba_norm,
                            lambda normed: self.mamba(normed, inputs.documents, inputs.context))
