"""Multi-token prediction's rules, checked before any process group exists."""

from __future__ import annotations

from parallel.topology import Topology
from pretrain.config.arguments import ConfigError
from pretrain.config.schema import Config


def validate_mtp(config: Config, topology: Topology) -> None:
    """Multi-token prediction's layouts so far: over pipeline stages no learned positions (the last
    stage's copy of the embedding embeds the depths' tokens)."""
    depths, model = config.model.mtp_depths, config.model
    if not depths:
        return
    for flag, used in (("--qk-clip / --log-max-attention-logit", config.optimizer.qk_clip
                        or config.optimizer.log_max_attention_logit),
                       ("--window-size", model.window_size is not None)):
        if used:
            raise ConfigError(f"--mtp-num-layers {depths} with {flag}: its per-layer settings do not cover "
                              "the depths' layers yet; drop one")
    if topology.pp > 1 and model.position_embedding == "learned_absolute":
        raise ConfigError(f"--mtp-num-layers {depths} with --pipeline-model-parallel-size {topology.pp}: the "
                          "last stage's depths embed their tokens with its copy of the embedding (not its "
                          "learned positions, which the first stage holds); use --position-embedding-type "
                          "rope or none")
