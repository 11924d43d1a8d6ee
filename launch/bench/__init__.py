"""Benchmarks against peers (torch DDP, FSDP2, DeepSpeed-style baselines), each system in its own world
where it matters, reported as ratios measured in the same run; with the worlds, the plain GPT and the
emulated slow link they run on. ``python -m launch.bench.NAME``."""
