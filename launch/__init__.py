"""Starting jobs: torchrun and the shell / SLURM launchers, their configs and the helpers that run the
trainer as a subprocess (pretrain_run) at the top; operator tools in ``launch.tools``, benchmarks in
``launch.bench``, demonstrations in ``launch.examples``."""
