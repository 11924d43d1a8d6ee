"""The ZeRO optimizer over the data-parallel group.

``initialize(module, optimizer_factory, ZeroOptions(stage=S, ...), group)`` returns ``(module, optimizer)``
for any ``nn.Module``; train with ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` (under fp16,
call backward on ``optimizer.scale_loss(loss)``). ``optimizer_factory`` takes torch-style parameter
groups and returns a torch optimizer: an element-wise one sees only this rank's fp32 shard; Muon
(``torch.optim.Muon`` or ``parallel.muon.Muon``) runs on whole matrices gathered on their owners; one that
reads whole tensors otherwise (Adafactor, LBFGS) is refused (``wrapped_optimizer``).
"""

from __future__ import annotations

from torch import nn

from parallel.buffer_pool import BufferPool
from parallel.zero.auto_wrap import unit_modules as unit_modules_of
from parallel.zero.chained import ChainedZeroOptimizer
from parallel.zero.grad_sync import ModelParallelGroups
from parallel.zero.loss_scaler import ConstantLossScaler, DynamicLossScaler
from parallel.zero.memory import (expected_model_state_bytes, expected_parameter_state_bytes, gradient_bytes,
                                  optimizer_state_bytes)
from parallel.zero.groups import ZeroGroups, dp_partitions
from parallel.zero.optimizer import OptimizerFactory, StepResult, ZeroOptimizer
from parallel.zero.options import ZeroOptions

__all__ = ["initialize", "ZeroOptions", "ZeroGroups", "dp_partitions", "ZeroOptimizer",
           "ChainedZeroOptimizer", "ModelParallelGroups",
           "StepResult", "DynamicLossScaler",
           "ConstantLossScaler", "expected_model_state_bytes", "expected_parameter_state_bytes",
           "gradient_bytes", "optimizer_state_bytes"]


def initialize(module: nn.Module, optimizer_factory: OptimizerFactory, options: ZeroOptions = ZeroOptions(),
               group=None, *, param_groups: list[dict] | None = None, loss_scaler=None, unit_modules=None,
               buffer_pool: BufferPool | None = None,
               backward_parts: list[nn.Module] | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Wrap ``module`` for data-parallel training as ``options`` say over ``group``: ``ZeroGroups``, or a
    torch ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``parallel.comm.AxisGroup``, or None (the world).

    ``param_groups``: torch-style groups of the module's parameters with their optimizer options;
    ``loss_scaler``: a ``DynamicLossScaler`` for fp16; ``unit_modules`` (stage 3): the modules gathered as
    one, a list or module classes (default: the repeated blocks, ``auto_wrap.repeated_blocks``);
    ``buffer_pool``: a ``BufferPool`` shared with activation recompute (one of its own otherwise);
    ``backward_parts``: modules whose backward passes run apart, micro-batches of one between those of
    another (a pipeline rank's model chunks under an interleaved schedule): no gradient bucket spans two.
    Call ``optimizer.close()`` at the end to remove any swap files.
    """
    units = unit_modules_of(module, unit_modules) if options.stage == 3 else None
    return module, ZeroOptimizer(module, optimizer_factory, options, ZeroGroups.of(group, options),
                                 param_groups=param_groups, loss_scaler=loss_scaler, unit_modules=units,
                                 buffer_pool=buffer_pool, backward_parts=backward_parts)
