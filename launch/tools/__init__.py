"""Operator tools around a run: the layout planner and its link model, sweeps, the fault sweep, the GPU
check. Each is a ``python -m launch.tools.NAME`` command; none is imported by a training process."""
