"""``python -m pretrain [--config FILE.yaml] [flags]``: train a GPT (launched by torchrun, or alone)."""

from __future__ import annotations

import os
import sys
import warnings

from pretrain.arguments import ConfigError, parse_config
from pretrain.validation import validate


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        config = parse_config(argv)
        topology = validate(config, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    from parallel.process_groups import init_distributed, shutdown_distributed
    from pretrain.trainer import Trainer

    from pretrain.checkpoint import CheckpointError

    device = init_distributed(config.parallel.distributed_timeout_s)
    try:
        Trainer(config, topology, device).train()
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    shutdown_distributed()


if __name__ == "__main__":
    main()
