"""What the ZeRO optimizer holds per rank, predicted: the formula and the per-parameter rule it follows.

Model states per parameter (Rajbhandari et al.): the parameter in the compute precision, its
gradient in the gradient dtype (fp32 main gradients for 16-bit parameters by default, as Megatron
keeps them: 4 bytes where the paper counts 2; 2 with --grad-reduce-in-bf16), plus an fp32 master
(when the parameters are not fp32 already) and Adam's two fp32 moments;
stage 1 shards the masters and moments over dp, stage 2 also the gradients, stage 3 also the
parameters. Stage 3 keeps small parameters and those whose gradients need a tensor- or
pipeline-parallel reduction first whole, as stage 2 does (``sharded_at_stage_3``, the optimizer's own
rule). The trainer's start-up table and ``launch.tools.planning.plan`` both price a rank's parameters here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from torch import nn

from parallel.zero.grad_sync import needs_model_parallel_reduction


def sharded_at_stage_3(param: nn.Parameter, persistence_threshold: int) -> bool:
    """Whether stage 3 shards ``param`` (else it stays whole, with sharded gradients as in stage 2)."""
    return sharded_by_size(param.numel(), needs_model_parallel_reduction(param), persistence_threshold)


def sharded_by_size(numel: int, whole: bool, persistence_threshold: int) -> bool:
    """``sharded_at_stage_3`` of a parameter of ``numel`` elements whose gradient a model-parallel
    reduction needs ``whole`` (or not)."""
    return numel > persistence_threshold and not whole


def gradient_bytes(compute_bytes: int, main_grads_in_fp32: bool = True) -> int:
    """Bytes per gradient element: fp32 main gradients for 16-bit parameters unless turned off."""
    return 4 if main_grads_in_fp32 else compute_bytes


def optimizer_state_bytes(compute_bytes: int, moments: int = 2) -> int:
    """Bytes per parameter of what the optimizer step owns (and offload moves): an fp32 master where the
    parameters are not fp32 already, and ``moments`` fp32 states (Adam's two; Muon's and SGD's momentum)."""
    return (4 if compute_bytes != 4 else 0) + 4 * moments


def expected_model_state_bytes(stage: int, params: int, dp: int, compute_bytes: int,
                               grad_bytes: int | None = None, moments: int = 2) -> float:
    """Model-state bytes of ``params`` elements at ``stage``, ``compute_bytes`` per compute element,
    ``grad_bytes`` per gradient element (default: fp32 main gradients) and ``moments`` optimizer states."""
    grad = gradient_bytes(compute_bytes) if grad_bytes is None else grad_bytes
    states = optimizer_state_bytes(compute_bytes, moments)
    if stage == 0:
        return params * (compute_bytes + grad + states)
    if stage == 1:
        return params * (compute_bytes + grad) + params * states / dp
    if stage == 2:
        return params * compute_bytes + params * (grad + states) / dp
    return params * (compute_bytes + grad + states) / dp


def parameter_profile(params: Iterable[nn.Parameter], moments: Callable[[nn.Parameter], int] = lambda param: 2
                      ) -> tuple[tuple[int, ...], ...]:
    """(elements, whether a model-parallel reduction needs the gradient whole, the optimizer's fp32 states
    per element, how many such parameters): all that the state bytes of ``params`` depend on (a planner
    keeps it per layout and model)."""
    counts = Counter((param.numel(), needs_model_parallel_reduction(param), moments(param))
                     for param in params)
    return tuple((numel, whole, states, count) for (numel, whole, states), count in sorted(counts.items()))


def expected_parameter_state_bytes(params: Iterable[nn.Parameter], stage: int, dp: int, compute_bytes: int,
                                   persistence_threshold: int = 100_000, grad_bytes: int | None = None,
                                   secondary_partition: int = 1,
                                   moments: Callable[[nn.Parameter], int] = lambda param: 2) -> float:
    """Model-state bytes of this rank's ``params`` as the optimizer keeps them at ``stage`` (with hpZ's
    secondary partition over ``secondary_partition`` ranks, stage 3's sharded parameters once more in the
    compute dtype, 1/K of them; ``moments``: each parameter's fp32 optimizer states per element)."""
    return expected_profile_state_bytes(parameter_profile(params, moments), stage, dp, compute_bytes,
                                        persistence_threshold, grad_bytes, secondary_partition)


def expected_profile_state_bytes(profile: tuple[tuple[int, ...], ...], stage: int, dp: int,
                                 compute_bytes: int, persistence_threshold: int = 100_000,
                                 grad_bytes: int | None = None, secondary_partition: int = 1) -> float:
    """``expected_parameter_state_bytes`` of the parameters a ``parameter_profile`` describes."""
    total = 0.0
    for numel, whole, moments, count in profile:
        sharded = stage == 3 and sharded_by_size(numel, whole, persistence_threshold)
        total += count * expected_model_state_bytes(stage if sharded or stage < 3 else 2, numel, dp,
                                                    compute_bytes, grad_bytes, moments)
        if sharded and 1 < secondary_partition < dp:
            total += count * compute_bytes * numel / secondary_partition
    return total


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
