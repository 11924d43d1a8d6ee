"""The Kimi delta attention layer of a hybrid model (``K`` in ``--hybrid-layer-pattern``): x +
kda(kda_norm(x))."""

from __future__ import annotations

import torch

from models.attention import LayerInputs
from models.config import GPTConfig
from models.kda.mixer import KimiDeltaAttention
from models.layers.residual import ResidualLayer
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.tensor.random import RNGTracker


class KimiDeltaLayer(ResidualLayer):
    """Owns its pre-norm (``kda_norm``, the model's --normalization) and its ``KimiDeltaAttention``; the
    state starts afresh at each document with --reset-attention-mask (the inputs' ``documents``)."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker, context: ContextParallel | None = None):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        self.kda_norm = build_norm(config, config.hidden_size, sequence_parallel)
        self.kda = KimiDeltaAttention(config, layer, tp, seed, sequence_parallel, context)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        return self._branch(x, self.kda_norm,
                            lambda normed: self.kda(normed, inputs.documents, inputs.context))
