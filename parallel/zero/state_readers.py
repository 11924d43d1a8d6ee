"""Readers of a ``ZeroOptimizer.state_dict()`` saved in any layout: what a re-cut
(``pretrain.checkpoint.reshard``) or a checkpoint load takes out of it, without building the optimizer that
saved it."""

from __future__ import annotations

import torch

from parallel.zero.offload import is_per_element


def saved_piece(state: dict, master: int, state_index: int, kind: str) -> torch.Tensor | None:
    """Master ``master`` (kind "master") or per-element state ``kind`` of torch-optimizer state
    ``state_index`` (None where the optimizer never stepped)."""
    if kind == "master":
        return state["masters"][master]
    return state["optimizer"]["state"].get(state_index, {}).get(kind)


def saved_scalars(state: dict, state_index: int) -> dict:
    """The per-parameter scalars (Adam's step) of torch-optimizer state ``state_index``."""
    return {key: value for key, value in state["optimizer"]["state"].get(state_index, {}).items()
            if not is_per_element(value)}


def saved_kinds(state: dict) -> set[str]:
    """The per-element optimizer states (Adam's two moments) the state holds."""
    return {kind for per_master in state["optimizer"]["state"].values() for kind, value in per_master.items()
            if is_per_element(value)}


def saved_loss_scaler(state: dict) -> dict:
    return state["loss_scaler"]
