"""Whether a kept kernel library (mamba-ssm, flash-linear-attention) can be imported here: each mixer's
kernels choose their GPU path by it and fall back to the PyTorch reference."""

from __future__ import annotations

import importlib.util


def installed(module: str | None) -> bool:
    """Whether ``module`` (a kernel library; None: the reference) can be imported here."""
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
