"""The transformer's MLP: GELU, squared ReLU, SwiGLU, GeGLU or quick GeGLU (gpt-oss's, with Megatron's
--glu-linear-offset and --activation-func-clamp-value), split across the tensor-parallel group by width."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from parallel.comm import AxisGroup
from parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from parallel.tensor.weight_init import WeightInit


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel). Never holds the full ffn activation.

    Gated (SwiGLU, GeGLU, quick GeGLU) ``fc1`` holds the gate and up matrices stacked ([2, ffn/tp, h] per
    rank, each split by width), so a rank computes act(gate) * up on its own slice of both, whatever tp is.
    """

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 width: int | None = None, name: str = "mlp"):
        super().__init__()
        h, f, std = config.hidden_size, width or config.ffn_size, config.matrix_init_std
        self.activate = activation_of(config)
        bias = not config.disable_bias_linear
        self.fc1 = ColumnParallelLinear(h, f, tp,
                                        WeightInit(seed, f"layers.{layer}.{name}.fc1.weight", std), bias=bias,
                                        sequence_parallel=sequence_parallel,
                                        stacked=2 if config.gated else 1)
        self.fc2 = RowParallelLinear(f, h, tp, WeightInit(seed, f"layers.{layer}.{name}.fc2.weight", std)
                                     .scaled_for_residual(config.residual_branches), bias=bias,
                                     sequence_parallel=sequence_parallel)
        self.runner = None  # how the MLP runs when it is recomputed (``recompute_with``)

    RECOMPUTE_MODULE = "mlp"  # --recompute-modules mlp recomputes it

    def recompute_with(self, runner) -> None:
        """Run the MLP through ``runner(compute, x)`` (--recompute-modules mlp)."""
        self.runner = runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(self.compute, x) if self.runner is not None else self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x))): what --recompute-modules mlp redoes in backward."""
        return self.fc2(self.activate(self.fc1(x)))


def activation_of(config: GPTConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """``activate`` with the model's choices: the activation, GELU's approximation (--openai-gelu), and a
    gated one's --glu-linear-offset and --activation-func-clamp-value (the dense MLP's and the experts')."""
    return functools.partial(activate, activation=config.activation,
                             gelu_approximation="tanh" if config.openai_gelu else "none",
                             offset=config.glu_linear_offset, clamp=config.activation_func_clamp_value)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's sigmoid approximation, x sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def activate(y: torch.Tensor, activation: str, gelu_approximation: str = "none", offset: float = 0.0,
             clamp: float | None = None) -> torch.Tensor:
    """The MLP's activation of fc1's output ``y``. Gated, its last dim holds the gate, then the up part:
    act(gate) * (up + offset), gate first clamped to <= ``clamp`` and up to [-clamp, clamp] (Megatron's
    order: the clamp, then the activation)."""
    if activation in ("swiglu", "geglu", "quick_geglu"):
        gate, up = y.chunk(2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        act = (F.silu(gate) if activation == "swiglu" else quick_gelu(gate) if activation == "quick_geglu"
               else F.gelu(gate, approximate=gelu_approximation))
        return act * (up + offset if offset else up)
    if activation == "squared_relu":
        return F.relu(y).square()
    return F.gelu(y, approximate=gelu_approximation)
