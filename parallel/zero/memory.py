"""What the ZeRO optimizer holds per rank, predicted: the formula and the per-parameter rule it follows.

Model states per parameter (Rajbhandari et al.): the parameter and its gradient in the compute
precision, plus an fp32 master (when the parameters are not fp32 already) and Adam's two fp32 moments;
stage 1 shards the masters and moments over dp, stage 2 also the gradients, stage 3 also the
parameters. Stage 3 keeps small parameters and those whose gradients need a tensor- or
pipeline-parallel reduction first whole, as stage 2 does (``sharded_at_stage_3``, the optimizer's own
rule). The trainer's start-up table and ``launch.plan`` both price a rank's parameters here.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from parallel.zero.grad_sync import needs_model_parallel_reduction


def sharded_at_stage_3(param: nn.Parameter, persistence_threshold: int) -> bool:
    """Whether stage 3 shards ``param`` (else it stays whole, with sharded gradients as in stage 2)."""
    return param.numel() > persistence_threshold and not needs_model_parallel_reduction(param)


def expected_model_state_bytes(stage: int, params: int, dp: int, compute_bytes: int) -> float:
    """Model-state bytes of ``params`` elements at ``stage``, ``compute_bytes`` per compute element."""
    master = 4 if compute_bytes != 4 else 0
    states = master + 8
    if stage == 0:
        return params * (2 * compute_bytes + states)
    if stage == 1:
        return params * (2 * compute_bytes) + params * states / dp
    if stage == 2:
        return params * compute_bytes + params * (compute_bytes + states) / dp
    return params * (2 * compute_bytes + states) / dp


def expected_parameter_state_bytes(params: Iterable[nn.Parameter], stage: int, dp: int, compute_bytes: int,
                                   persistence_threshold: int = 100_000) -> float:
    """Model-state bytes of this rank's ``params`` as the optimizer keeps them at ``stage``."""
    total = 0.0
    for param in params:
        kept = 2 if stage == 3 and not sharded_at_stage_3(param, persistence_threshold) else stage
        total += expected_model_state_bytes(kept, param.numel(), dp, compute_bytes)
    return total
