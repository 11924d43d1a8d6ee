"""Which ZeRO options each stage can take: checked once, before an optimizer builds anything."""

from __future__ import annotations

from parallel.comm import AxisGroup


def check_stage_options(stage: int, dp: AxisGroup, offload_optimizer: str, offload_param: str,
                        quantized_weights: bool, secondary_partition: AxisGroup | None,
                        quantized_gradients: list[AxisGroup] | None, replicas: AxisGroup | None) -> None:
    """Raise ValueError naming the flag when ``stage`` cannot do what the options ask."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {stage} is unknown: choose 0, 1, 2 or 3")
    if offload_optimizer not in ("none", "cpu", "nvme"):
        raise ValueError(f"--offload-optimizer {offload_optimizer} is unknown: choose none, cpu or nvme")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(f"--offload-optimizer {offload_optimizer} needs --zero-stage 1, 2 or 3 (stage 0 keeps "
                         "no optimizer shard to offload)")
    if offload_param not in ("none", "nvme"):
        raise ValueError(f"--offload-param {offload_param} is not available: choose none or nvme")
    if offload_param == "nvme" and stage != 3:
        raise ValueError("--offload-param nvme needs --zero-stage 3 (only stage 3 shards the parameters)")
    if quantized_weights and stage == 0:
        raise ValueError("--zero-quantized-weights needs --zero-stage 1, 2 or 3 (stage 0 gathers no parameters)")
    if replicas is not None and replicas.size > 1 and stage == 0:
        raise ValueError(f"a shard group of {dp.size} with {replicas.size} replicas needs --zero-stage 1, 2 or 3 "
                         "(stage 0 shards nothing)")
    if quantized_gradients is not None and stage < 2:
        raise ValueError(f"--zero-quantized-gradients needs --zero-stage 2 or 3 (stage {stage} reduces the "
                         "gradients in place in the flat buffer)")
    if secondary_partition is not None and secondary_partition.size > 1 and stage != 3:
        raise ValueError(f"--zero-hpz-partition-size {secondary_partition.size} needs --zero-stage 3 (only stage 3 "
                         "gathers parameters in forward and backward)")
