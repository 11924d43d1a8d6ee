"""Operator tools around a run, by concern: ``planning`` (the layout planner, what a layout costs and the
link model), ``scaling`` (sweeps, IsoFLOP sizing, scaling-law fits and their plots), ``faults`` (the
fault sweep, fault injection, the chaos harness), ``gpu_check``, and ``draft`` (greedy speculative decoding
with a checkpoint's multi-token prediction depths). Each is a ``python -m`` command (the
short names ``launch.plan``, ``launch.sweep``, ``launch.scaling_law``, ``launch.chaos`` and
``launch.tools.fault_sweep`` run them); none is imported by a training process."""
