"""Layout-independent weight initialisation.

Every weight is drawn in full (its "master" shape, as in the single-process model) from a generator
seeded by (seed, weight name), then each rank keeps its slice. So the numbers of a model do not
depend on tp, pp, dp or on which rank builds which layer, and a layer can be built alone (ZeRO-3
constructs the model layer by layer).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightInit:
    """Normal(0, std) initialisation of one named weight from a seed (``uniform``: a uniform draw from the
    same generator, for the few weights whose law is not normal).

    Owns only (seed, name, std); it never touches a module. ``full(shape)`` returns the master weight.
    """

    seed: int
    name: str
    std: float

    def full(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        full = torch.empty(shape, dtype=torch.float32)
        if full.is_meta:  # a model built on the meta device has shapes only (a draw there imports torch's
            return full.to(dtype)  # decompositions and dynamo: about a second per process)
        return full.normal_(0.0, self.std, generator=self._generator()).to(dtype)

    def uniform(self, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        """The master weight drawn from U(low, high) instead (fp32; ``std`` unused)."""
        full = torch.empty(shape, dtype=torch.float32)
        return full if full.is_meta else full.uniform_(low, high, generator=self._generator())

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(self.name.encode())) % 2**63)

    def scaled_for_residual(self, branches: int) -> "WeightInit":
        """The GPT-2 / Megatron scaled init for projections that feed the residual stream: std / sqrt of the
        ``branches`` adding into it (a GPT block has two)."""
        return WeightInit(self.seed, self.name, self.std / math.sqrt(branches))
