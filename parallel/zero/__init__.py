"""The ZeRO optimizer over the data-parallel group.

``initialize(module, optimizer_factory, stage=S, **options)`` returns ``(module, optimizer)`` for any
``nn.Module``; train with ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` (under fp16,
call backward on ``optimizer.scale_loss(loss)``). ``optimizer_factory`` takes torch-style parameter
groups and returns any torch optimizer; it only ever sees this rank's fp32 shard.
"""

from __future__ import annotations

from torch import nn

from parallel.comm import as_axis_group
from parallel.zero.auto_wrap import unit_modules
from parallel.zero.grad_sync import ModelParallelGroups
from parallel.zero.loss_scaler import ConstantLossScaler, DynamicLossScaler
from parallel.zero.memory import (expected_model_state_bytes, expected_parameter_state_bytes, gradient_bytes,
                                  optimizer_state_bytes)
from parallel.zero.optimizer import OptimizerFactory, StepResult, ZeroOptimizer

__all__ = ["initialize", "ZeroOptimizer", "ModelParallelGroups", "StepResult", "DynamicLossScaler",
           "ConstantLossScaler", "expected_model_state_bytes", "expected_parameter_state_bytes",
           "gradient_bytes", "optimizer_state_bytes"]


def initialize(module: nn.Module, optimizer_factory: OptimizerFactory, *, stage: int, group=None,
               **options) -> tuple[nn.Module, ZeroOptimizer]:
    """Wrap ``module`` for data-parallel training with ZeRO ``stage`` over the data-parallel ``group``: a
    torch ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``parallel.comm.AxisGroup``, or None (the world).

    Options: ``param_groups`` (torch-style groups of the module's parameters, with their optimizer
    options), ``bucket_size`` (elements per fused collective), ``clip_grad`` (max global norm),
    ``model_parallel`` (``ModelParallelGroups``), ``loss_scaler`` (``DynamicLossScaler`` for fp16);
    stage 3: ``unit_modules`` (the modules gathered as one: a list, or module classes; by default the
    repeated blocks, ``auto_wrap.repeated_blocks``),
    ``persistence_threshold`` (parameters up to this many elements stay whole), ``prefetch_budget``
    (elements of gathered parameters allowed alive when prefetching; None: twice the largest unit); ``buffer_pool`` (a
    ``parallel.buffer_pool.BufferPool`` shared with activation checkpointing; one of its own otherwise);
    offload: ``offload_optimizer`` ("none", "cpu", "nvme"), ``offload_param`` ("none", "nvme"; stage 3),
    ``nvme_path`` (a directory for the swap files), ``sub_group_size`` (elements stepped at a time from
    the files, and the largest master; default: a twentieth of the rank's shard); ``main_grads_in_fp32`` (default True: 16-bit parameters' gradients are accumulated and
    reduced in fp32; False: in the parameters' dtype); ``quantized_weights`` (stages 1-3: parameter all-gathers
    sent as block-wise int8, ZeRO++'s qwZ), ``secondary_partition`` (stage 3, ZeRO++'s hpZ: an ``AxisGroup`` of K
    data-parallel ranks within a node, e.g. ``ParallelGroups.dp_partition(K)[0]``, holding a secondary copy of
    the parameters that every gather but a step's first of a unit comes from). Call ``optimizer.close()`` at the end to remove the swap files.
    """
    if stage == 3:
        options["unit_modules"] = unit_modules(module, options.get("unit_modules"))
    return module, ZeroOptimizer(module, optimizer_factory, as_axis_group(group), stage=stage, **options)
