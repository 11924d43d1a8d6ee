"""The ZeRO optimizer over the data-parallel group.

``initialize(module, optimizer_factory, stage=S, group=G, **options)`` returns ``(module, optimizer)``;
train with ``loss.backward(); optimizer.step(); optimizer.zero_grad()``. ``optimizer_factory`` takes
torch-style parameter groups and returns any torch optimizer.
"""

from __future__ import annotations

from torch import nn

from parallel.comm import AxisGroup
from parallel.zero.data_parallel import DataParallelOptimizer, ModelParallelGroups, OptimizerFactory, StepResult

AVAILABLE_STAGES = (0,)

__all__ = ["initialize", "DataParallelOptimizer", "ModelParallelGroups", "StepResult", "AVAILABLE_STAGES"]


def initialize(module: nn.Module, optimizer_factory: OptimizerFactory, *, stage: int, group: AxisGroup,
               **options) -> tuple[nn.Module, DataParallelOptimizer]:
    """Wrap ``module`` for data-parallel training with ZeRO ``stage`` over the data-parallel ``group``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {stage} is unknown: choose 0, 1, 2 or 3")
    if stage not in AVAILABLE_STAGES:
        raise ValueError(f"--zero-stage {stage} is not available in this build yet: use --zero-stage 0")
    return module, DataParallelOptimizer(module, optimizer_factory, group, **options)
