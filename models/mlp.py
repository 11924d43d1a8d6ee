"""The transformer's MLP: GELU, squared ReLU, SwiGLU or GeGLU, split across the tensor-parallel group by
width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from parallel.comm import AxisGroup
from parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallel.tensor.weight_init import WeightInit


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel). Never holds the full ffn activation.

    Gated (SwiGLU, GeGLU) ``fc1`` holds the gate and up matrices stacked ([2, ffn/tp, h] per rank, each
    split by width), so a rank computes act(gate) * up on its own slice of both, whatever tp is.
    """

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool):
        super().__init__()
        h, f, std = config.hidden_size, config.ffn_size, config.init_method_std
        self.activation = config.activation
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        bias = not config.disable_bias_linear
        self.fc1 = ColumnParallelLinear(h, f, tp,
                                        WeightInit(seed, f"layers.{layer}.mlp.fc1.weight", std), bias=bias,
                                        sequence_parallel=sequence_parallel,
                                        stacked=2 if config.gated else 1)
        self.fc2 = RowParallelLinear(f, h, tp, WeightInit(seed, f"layers.{layer}.mlp.fc2.weight", std)
                                     .scaled_for_residual(config.num_layers), bias=bias,
                                     sequence_parallel=sequence_parallel)
        self.runner = None  # how the MLP runs when it is recomputed (``recompute_with``)

    def recompute_with(self, runner) -> None:
        """Run the MLP through ``runner(compute, x)`` (--recompute-modules mlp)."""
        self.runner = runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(self.compute, x) if self.runner is not None else self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x))): what --recompute-modules mlp redoes in backward."""
        y = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.activation == "geglu":
            gate, up = y.chunk(2, dim=-1)
            y = F.gelu(gate, approximate=self.gelu_approximation) * up
        elif self.activation == "squared_relu":
            y = F.relu(y).square()
        else:
            y = F.gelu(y, approximate=self.gelu_approximation)
        return self.fc2(y)
