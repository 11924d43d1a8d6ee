"""Training a GPT: the run's configuration, the checks before it starts, the training loop, its
checkpoints, Hugging Face interop and what it reports. ``python -m pretrain`` is the entry point.

Sub-packages, each one concern: ``config`` (what a run is: dataclasses = flags = YAML keys),
``startup`` (what is settled and checked before training), ``training`` (the loop and what feeds it),
``checkpoint`` (saving, finding, verifying and re-cutting checkpoints), ``interop`` (Hugging Face and
file conversions), ``observability`` (metrics files, console, wandb, tensorboard).
"""
