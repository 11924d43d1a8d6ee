"""A weight (and a bias) held under the name megatron-core gives it (``conv1d``, ``norm``)."""

from __future__ import annotations

from torch import nn


class Held(nn.Module):
    """Owns ``weight`` (and ``bias``) under a submodule's name, so that state-dict keys read as
    megatron-core's (``conv1d.weight``); it computes nothing: the mixer that holds it uses them."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
