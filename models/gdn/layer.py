"""The gated delta net layer of a hybrid model (``G`` in ``--hybrid-layer-pattern``): x + gdn(gdn_norm(x))."""

from __future__ import annotations

import torch

from models.attention import LayerInputs
from models.config import GPTConfig
from models.gdn.mixer import GatedDeltaNet
from models.layers.residual import ResidualLayer
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.tensor.random import RNGTracker


class GatedDeltaLayer(ResidualLayer):
    """Owns its pre-norm (``gdn_norm``, the model's --normalization) and its ``GatedDeltaNet``; the state
    starts afresh at each document with --reset-attention-mask (the inputs' ``documents``)."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker, context: ContextParallel | None = None):
        super().__init__(config, layer, tp, sequence_parallel, rng)
        self.gdn_norm = build_norm(config, config.hidden_size, sequence_parallel)
        self.gdn = GatedDeltaNet(config, layer, tp, seed, sequence_parallel, context)

    def forward(self, x: torch.Tensor, inputs: LayerInputs = LayerInputs()) -> torch.Tensor:
        return self._branch(x, self.gdn_norm,
                            lambda normed: self.gdn(normed, inputs.documents, inputs.context))
