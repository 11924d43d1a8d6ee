"""The training loop of one rank and what feeds it: the build of groups, model and optimizer, the
pipeline runner, batch and learning-rate schedules, the data position and the run's decisions."""
