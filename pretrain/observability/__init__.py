"""What a run reports: the metrics file and console lines, the start-up tables, wandb and tensorboard."""
