"""Muon: momentum orthogonalized by Newton-Schulz on each matrix, AdamW on the rest (``Muon``), the
iterations and scales of Megatron-LM's flags (``newton_schulz``, ``matrices``)."""

from parallel.muon.matrices import MuonSettings, orthogonalization_flops, orthogonalized
from parallel.muon.newton_schulz import COEFFICIENT_SETS, PRECISIONS, SCALE_MODES, newton_schulz
from parallel.muon.optimizer import Muon, local_matrices, settings_of_torch_muon

__all__ = ["Muon", "MuonSettings", "orthogonalized", "orthogonalization_flops", "newton_schulz",
           "local_matrices", "settings_of_torch_muon", "COEFFICIENT_SETS", "PRECISIONS", "SCALE_MODES"]
