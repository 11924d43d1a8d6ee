"""Start the wandb run of rank 0: offline unless the user configured wandb to go online."""

from __future__ import annotations

import netrc
import os

from pretrain.config.schema import Config


def wandb_is_configured_online() -> bool:
    """True when the user asked for online logging: WANDB_MODE=online, an API key, or a wandb login."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"] == "online"
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def start_wandb(config: Config):
    """A wandb run with the full config, or None when no --wandb-project is set."""
    logging = config.logging
    if not logging.wandb_project:
        return None
    import wandb

    os.makedirs(logging.wandb_dir, exist_ok=True)
    return wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name, group=logging.wandb_group,
                      config=config.to_dict(),
                      dir=logging.wandb_dir, mode="online" if wandb_is_configured_online() else "offline")
