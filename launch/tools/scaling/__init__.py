"""Scaling studies: ``sweep`` (a grid of runs or IsoFLOP runs: ``python -m launch.sweep``) sized by
``isoflop``, and ``scaling_law`` (``python -m launch.scaling_law``) fitting Chinchilla's three approaches
in ``scaling_fits``, drawn by ``scaling_plots``."""
