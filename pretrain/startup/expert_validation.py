"""The mixture-of-experts settings checked against the layout, before any process group exists."""

from __future__ import annotations

from dataclasses import fields

from models.moe.config import MoEConfig
from parallel.topology import Topology
from pretrain.config.arguments import ConfigError
from pretrain.config.schema import Config


MOE_SETTINGS = {f.name for f in fields(MoEConfig)}  # the settings that mean nothing without --num-experts


def validate_experts(config: Config, topology: Topology) -> None:
    """Raise ConfigError (naming the flag and the fix) for expert settings this layout cannot run."""
    model, par, zero = config.model, config.parallel, config.zero
    if not model.num_experts:
        if topology.ep > 1 or topology.expert_tp != topology.tp:
            raise ConfigError("--expert-model-parallel-size / --expert-tensor-parallel-size lay out experts: "
                              "add --num-experts (or drop them)")
        moe_flags = sorted(f"--{name.replace('_', '-')}" for name in config.given
                           if name in MOE_SETTINGS and name != "num_experts")
        if moe_flags:
            raise ConfigError(f"{', '.join(moe_flags)} set{'s' if len(moe_flags) == 1 else ''} up mixture-of-"
                              "experts layers, which this model has none of: add --num-experts (or drop "
                              f"{'it' if len(moe_flags) == 1 else 'them'})")
        return
    try:
        model.validate_moe(model.num_layers, model.ffn_size, topology.expert_tp, topology.ep)
    except ValueError as error:
        message = str(error).replace(f"--expert-tensor-parallel-size {topology.expert_tp}",
                                     topology.expert_tp_flag)
        raise ConfigError(message) from None
    if topology.tp > 1 and not par.sequence_parallel:
        raise ConfigError("MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel (each "
                          "tp rank routes its own share of the tokens; without it every token would reach "
                          "its experts tp times), as Megatron requires")
    if (model.moe_expert_capacity_factor is not None and model.moe_token_drop_policy == "position"
            and topology.cp > 1):
        raise ConfigError("--moe-token-drop-policy position with --context-parallel-size > 1: the zig-zag "
                          "cut of each sequence hides the tokens' order from the dropping; use probs or cp 1")
    partitions = {"--zero-hpz-partition-size": zero.zero_hpz_partition_size > 1,
                  "--zero-quantized-gradients": zero.zero_quantized_gradients,
                  "--zero-shard-size": zero.zero_shard_size is not None}
    given = [flag for flag, used in partitions.items() if used]
    if given:
        raise ConfigError(f"{', '.join(given)} with --num-experts: the expert parameters' ZeRO over the "
                          "expert data-parallel group has no partitions yet; drop it")
