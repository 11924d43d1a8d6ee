"""The test suite: one folder per top-level package, multi-process worlds (world.py) and the parity
bounds every layout is held to (parity.py)."""
