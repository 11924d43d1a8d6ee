"""A run of layers, each ``layer(x, inputs)``: the model's own, and each prediction depth's."""

from __future__ import annotations

import torch

from models.attention import LayerInputs


class LayerStack:
    """Mixed into a module with ``layers``: runs them in order, or through the runner full recompute
    installs (``recompute_layers_with``). Owns that runner only; never builds or holds layers itself."""

    layer_runner = None  # how the layers run when they are recomputed (``recompute_layers_with``)

    def recompute_layers_with(self, runner) -> None:
        """Run the layers through ``runner(x, inputs)`` (full recompute; activation checkpointing)."""
        self.layer_runner = runner

    def run_layers(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """``x`` [s, b, h] through the layers."""
        if self.layer_runner is not None:
            return self.layer_runner(x, inputs)
        for layer in self.layers:
            x = layer(x, inputs)
        return x
