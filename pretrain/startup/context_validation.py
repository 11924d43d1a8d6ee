"""Context parallelism's rules, checked before any process group exists."""

from __future__ import annotations

from parallel.topology import Topology
from pretrain.config.arguments import ConfigError
from pretrain.config.schema import Config


def validate_context(config: Config, topology: Topology) -> None:
    """Context parallelism's rules: the sequence cuts into 2 x cp chunks (and each rank's share into tp
    pieces under sequence parallelism), one known --cp-comm-type or one per layer, a2a's heads divide."""
    par, model, cp = config.parallel, config.model, topology.cp
    kinds = par.cp_comm_type
    if "a2a+p2p" in kinds or par.hierarchical_context_parallel_sizes is not None:
        raise ConfigError("--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes: hierarchical "
                          "context parallelism is not implemented; use --cp-comm-type p2p, a2a or allgather")
    if len(kinds) not in (1, model.num_layers):
        raise ConfigError(f"--cp-comm-type has {len(kinds)} values: give one, or one per layer "
                          f"(--num-layers {model.num_layers})")
    if cp == 1:
        return
    try:
        model.validate_sequence_layers(topology.tp, cp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model.softmax_type != "vanilla":
        raise ConfigError(f"--softmax-type {model.softmax_type} with --context-parallel-size {cp}: attention "
                          "sinks are not implemented under context parallelism; use cp 1")
    if model.seq_length % (2 * cp):
        raise ConfigError(f"--seq-length {model.seq_length} is not a multiple of 2 x --context-parallel-size "
                          f"{cp} = {2 * cp}: each sequence is cut into 2 x cp chunks")
    local = model.seq_length // cp
    if par.sequence_parallel and local % topology.tp:
        raise ConfigError(f"--sequence-parallel with --context-parallel-size {cp}: each rank's "
                          f"{local} tokens must divide by --tensor-model-parallel-size {topology.tp}")
    if "a2a" in kinds and model.has_attention:
        heads, groups = model.num_attention_heads // topology.tp, model.query_groups // topology.tp
        if heads % cp or groups % cp:
            raise ConfigError(f"--cp-comm-type a2a gives each cp rank heads of its own: the {heads} query "
                              f"heads and {groups} key/value groups per tensor-parallel rank must divide by "
                              f"--context-parallel-size {cp} (use p2p or allgather, or another cp)")
