"""What one Muon parameter orthogonalizes: its update as one matrix (leading dimensions folded into rows, so
a gated fc1 [2, f, h] is the [2f, h] matrix Megatron-LM fuses), or, for a fused QKV weight with
``split_qkv``, each of q, k and v on its own (``ParamMeta.fused_rows``), each scaled by its own shape.
Pure functions of the whole (or, blockwise, the tensor-parallel shard's) update: no state, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.muon.newton_schulz import (iteration_coefficients, newton_schulz, newton_schulz_flops,
                                         scale_factor)

TP_MODES = ("duplicated", "distributed", "blockwise")


@dataclass(frozen=True)
class MuonSettings:
    """The orthogonalization a Muon parameter group asks for (Megatron's --muon-* flags): never the
    momentum or the learning rate, which the optimizer applies."""

    ns_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    precision: str = "medium"
    ns_eps: float = 1e-7
    split_qkv: bool = True
    tp_mode: str = "duplicated"

    @classmethod
    def of(cls, group: dict) -> MuonSettings:
        """The settings of a torch-style parameter group (its keys named as these fields)."""
        return cls(**{name: group[name] for name in cls.__dataclass_fields__ if name in group})

    def check(self) -> None:
        """ValueError naming the flag of a setting Megatron's Muon would not take."""
        iteration_coefficients(self.coefficient_type, self.ns_steps)
        scale_factor(1, 1, self.scale_mode)
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {self.tp_mode!r} is not one of {', '.join(TP_MODES)}")
        if not self.extra_scale_factor > 0:  # (<= 0 stops or reverses every update)
            raise ValueError(f"--muon-extra-scale-factor {self.extra_scale_factor:g}: a factor on every Muon "
                             "update must be > 0 (0.2 matches AdamW's RMS)")


def _parts(shape: torch.Size, fused_rows: tuple[int, ...] | None, split_qkv: bool) -> list[tuple[int, int]]:
    """(rows, columns) of each matrix of an update of ``shape``."""
    columns = shape[-1]
    rows = shape.numel() // columns if columns else 0
    if not (split_qkv and fused_rows):
        return [(rows, columns)]
    groups = rows // sum(fused_rows)
    return [(groups * part, columns) for part in fused_rows]


def orthogonalized(update: torch.Tensor, fused_rows: tuple[int, ...] | None,
                   settings: MuonSettings) -> torch.Tensor:
    """The scaled orthogonalized ``update`` (fp32, ``update``'s shape): Newton-Schulz of each matrix, times
    its scale mode's factor and the extra scale factor."""
    result, scale = orthogonalized_and_scale(update, fused_rows, settings)
    return result.mul_(scale) if scale != 1.0 else result


def orthogonalized_and_scale(update: torch.Tensor, fused_rows: tuple[int, ...] | None,
                             settings: MuonSettings) -> tuple[torch.Tensor, float]:
    """``orthogonalized`` as (result, a factor still to apply): one matrix comes back unscaled with its
    factor, which the optimizer folds into the learning rate as torch.optim.Muon does (the same rounding);
    split parts come back scaled, factor 1."""
    coefficients = iteration_coefficients(settings.coefficient_type, settings.ns_steps)
    matrix = update.reshape(-1, update.shape[-1])

    def scale_of(part: torch.Tensor) -> float:
        return scale_factor(part.shape[0], part.shape[1], settings.scale_mode) * settings.extra_scale_factor

    def one(part: torch.Tensor) -> torch.Tensor:
        return newton_schulz(part, coefficients, settings.ns_eps, settings.precision)

    if not (settings.split_qkv and fused_rows):
        return one(matrix).view(update.shape), scale_of(matrix)
    per_group = matrix.view(-1, sum(fused_rows), matrix.shape[-1])
    parts = [part.reshape(-1, matrix.shape[-1]) for part in per_group.split(list(fused_rows), dim=1)]
    parts = [one(part).mul_(scale_of(part)).view(per_group.shape[0], -1, matrix.shape[-1]) for part in parts]
    return torch.cat(parts, dim=1).view(update.shape), 1.0


def orthogonalization_flops(shape: torch.Size, fused_rows: tuple[int, ...] | None,
                            settings: MuonSettings) -> int:
    """FLOPs of ``orthogonalized`` on an update of ``shape`` (what an owner is balanced by)."""
    return sum(newton_schulz_flops(rows, columns, settings.ns_steps)
               for rows, columns in _parts(shape, fused_rows, settings.split_qkv))
