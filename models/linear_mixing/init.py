"""megatron-core's initial values of a linear-time mixer's own parameters (Mamba-2's laws; the delta
nets draw their convolution's weight and A_log from them), drawn in full (the master) from a
``WeightInit`` seed per name, as every weight here is: the same numbers in every layout.

- the convolution: weight and bias U(-1/sqrt(K), 1/sqrt(K)) (PyTorch's Conv1d default);
- ``dt_bias``: dt = exp(U(ln dt_min, ln dt_max)) floored at 1e-4, stored as its inverse softplus, so
  that softplus(dt_bias) starts between dt_min and dt_max;
- ``A_log``: ln A with A ~ U[1, 16] (the decay per head is exp(-dt A));
(Mamba's ``D`` and gated norm weight, and the delta nets' ``dt_bias``, start at ones: their mixers
make them.)
"""

from __future__ import annotations

import math

import torch

from parallel.tensor.weight_init import WeightInit

DT_MIN, DT_MAX, DT_FLOOR = 0.001, 0.1, 1e-4
A_RANGE = (1.0, 16.0)


def conv_weight(seed: int, name: str, channels: int, taps: int) -> torch.Tensor:
    bound = 1 / math.sqrt(taps)
    return WeightInit(seed, name, 0.0).uniform((channels, 1, taps), -bound, bound)


def conv_bias(seed: int, name: str, channels: int, taps: int) -> torch.Tensor:
    bound = 1 / math.sqrt(taps)
    return WeightInit(seed, name, 0.0).uniform((channels,), -bound, bound)


def dt_bias(seed: int, name: str, heads: int) -> torch.Tensor:
    draw = WeightInit(seed, name, 0.0).uniform((heads,), math.log(DT_MIN), math.log(DT_MAX))
    dt = torch.exp(draw).clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))


def a_log(seed: int, name: str, heads: int) -> torch.Tensor:
    return torch.log(WeightInit(seed, name, 0.0).uniform((heads,), *A_RANGE))
