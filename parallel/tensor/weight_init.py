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
    """Normal(0, std) initialisation of one named weight from a seed.

    Owns only (seed, name, std); it never touches a module. ``full(shape)`` returns the master weight.
    """

    seed: int
    name: str
    std: float

    def full(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        full = torch.empty(shape, dtype=torch.float32)
        if full.is_meta:  # a model built on the meta device has shapes only (a draw there imports torch's
            return full.to(dtype)  # decompositions and dynamo: about a second per process)
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(self.name.encode()))
                                                  % 2**63)
        return full.normal_(0.0, self.std, generator=generator).to(dtype)

    def scaled_for_residual(self, num_layers: int) -> "WeightInit":
        """The GPT-2 / Megatron scaled init for projections that feed the residual stream."""
        return WeightInit(self.seed, self.name, self.std / math.sqrt(2.0 * num_layers))
