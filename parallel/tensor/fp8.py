"""FP8 matrix products for the tensor-parallel linear layers, through torchao's float8 training.

torchao owns the numerics (dynamic scales per tensor or per row, the casts, the scaled matrix product
and its backward); this module only builds torchao's configuration from Megatron's flags and runs a
layer's own weight through it. The weight stays the layer's parameter in its compute dtype (bf16, the
fp32 masters with ZeRO): it is cast to fp8 at each use, so ZeRO, checkpoints and the layouts see no
difference. Scales are taken over what a rank holds (its weight shard, its input features under tp),
which is finer than one process's and therefore no less exact.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
# torch._scaled_mm's constraint on each dimension of an fp8 matrix product; a layer whose (local) shape
# misses it stays in its compute dtype, as torchao's own filter leaves it
ALIGNMENT = 16


def preload_torchao() -> None:
    """torchao imported now, without its start-up chatter, where it is installed: transformers imports it
    as it builds a model, and its lines would reach the console of every tool that builds one."""
    try:
        torchao_float8()
    except ImportError:
        pass


def torchao_float8():
    """``torchao.float8``, imported without its start-up chatter (its CUDA extensions that a CPU build of
    torch cannot load, an enum it registers twice with torch): the run's own line says what fp8 does. Raises
    ImportError where torchao is not installed."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return torchao.float8


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Megatron's ``--fp8-format`` (e4m3: every operand e4m3; hybrid: e4m3 forward, e5m2 gradients),
    ``--fp8-recipe`` (tensorwise or rowwise scales) and ``--fp8-emulate`` (torchao's emulation: the fp8
    rounding in high-precision matrix products, for CPUs and GPUs without fp8). Owns no tensor."""

    format: str = "hybrid"
    recipe: str = "tensorwise"
    emulate: bool = False

    def torchao_config(self):
        base = torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        gradient = torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

        def gradient_cast(cast):
            return dataclasses.replace(cast, target_dtype=gradient)

        return dataclasses.replace(
            base, emulate=self.emulate,
            cast_config_grad_output=gradient_cast(base.cast_config_grad_output),
            cast_config_grad_output_for_grad_weight=gradient_cast(base.cast_config_grad_output_for_grad_weight))


class Float8Matmul:
    """``x W^T`` in fp8 for one layer: torchao's float8 linear, run on the layer's weight. Owns that
    linear's configuration (a shell whose weight is never stored: each call passes the layer's); never
    holds a parameter or any state between calls."""

    def __init__(self, in_features: int, out_features: int, recipe: Fp8Recipe):
        shell = nn.Sequential(nn.Linear(in_features, out_features, bias=False, device="meta"))
        torchao_float8().convert_to_float8_training(shell, config=recipe.torchao_config())
        self._linear = shell[0]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self._linear, {"weight": weight}, (x,))


def fp8_eligible(in_features: int, out_features: int) -> bool:
    """Whether torch's scaled matrix product takes a layer of this (local) shape."""
    return in_features % ALIGNMENT == 0 and out_features % ALIGNMENT == 0
