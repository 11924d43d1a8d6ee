"""Named random streams for dropout under tensor parallelism.

Outside tensor-parallel regions (replicated activations) dropout draws from the default generator,
seeded identically on every rank of a tensor-parallel group, so the replicas stay equal. Inside
them (split heads, sequence shards) it must differ per rank: ``RNGTracker.fork()`` swaps in a stream
seeded per tp rank for the duration of a block, then restores the default one. Recomputation saves
and restores both with ``state_dict`` / ``load_state_dict`` so that it redraws exactly the same masks.
"""

from __future__ import annotations

import contextlib

import torch

TENSOR_PARALLEL_STREAM = "tensor-parallel"


def _accelerator_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _default_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if _accelerator_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_default_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed: int) -> dict[str, torch.Tensor]:
    """The state of every device in use after ``manual_seed(seed)``, leaving the default stream as it was."""
    outside = _default_state()
    torch.manual_seed(seed)
    state = _default_state()
    _set_default_state(outside)
    return state


class RNGTracker:
    """Owns the seeds and states of named random streams (CPU, and the current GPU once one is in use).

    A stream created before the GPU was first used gets its GPU state on first use, from its seed. It
    never changes the default generator except inside ``fork``, which always restores it.
    """

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"random stream {name!r} already exists")
        self._seeds[name] = seed
        self._states[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM):
        """Draw from stream ``name`` inside the block; the default stream is untouched by it."""
        if name not in self._states:
            raise KeyError(f"random stream {name!r} was never added")
        outside = _default_state()
        if outside.keys() - self._states[name].keys():  # a device came into use after the stream was made
            self._states[name] = {**_seeded_state(self._seeds[name]), **self._states[name]}
        _set_default_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _default_state()
            _set_default_state(outside)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every stream's state, and the default one under ``"default"``."""
        states = {name: {k: v.clone() for k, v in state.items()} for name, state in self._states.items()}
        states["default"] = _default_state()
        return states

    def load_state_dict(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore what ``state_dict`` returned (the default stream included)."""
        states = dict(states)
        _set_default_state(states.pop("default"))
        self._states = {name: {k: v.clone() for k, v in state.items()} for name, state in states.items()}


def model_parallel_tracker(seed: int, tp_rank: int, pp_rank: int = 0, cp_rank: int = 0) -> RNGTracker:
    """The tracker a model part uses: a model-parallel stream that differs per tp rank, per stage and per
    context-parallel rank (each holds other tokens of the sequence)."""
    tracker = RNGTracker()
    tracker.add(TENSOR_PARALLEL_STREAM, seed + 2718 + tp_rank + 100 * pp_rank + 1_000_003 * cp_rank)
    return tracker
