"""Several ZeRO optimizers over disjoint parameters and groups, stepped and saved as one: a mixture of
experts' dense parameters (sharded over data x context) and expert parameters (over the expert
data-parallel group), as Megatron chains its dense and expert optimizers."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from parallel.zero.masters import MasterPiece
from parallel.zero.optimizer import ZeroOptimizer
from parallel.zero.step import StepResult, combined_norm, step_together


class ChainedZeroOptimizer:
    """The ``ZeroOptimizer`` interface over ``parts`` (the first one dense: its groups name the layout).

    Owns no state of its own: each part owns its parameters' masters, optimizer states and reductions; the
    parts share one loss scaler, and a step decides overflow, the gradient norm and clipping over all of
    them (``step_together``). A master piece is answered by the part that holds its parameter. It never
    communicates but through its parts.
    """

    def __init__(self, parts: list[ZeroOptimizer]):
        if len({id(part.loss_scaler) for part in parts}) != 1:
            raise ValueError("chained ZeRO optimizers must share one loss scaler")
        self.parts = parts
        self.dense = parts[0]
        self._part_of = {param: part for part in parts for param in part.params}

    # what the run reads of the dense part: its layout and settings
    @property
    def stage(self) -> int:
        return self.dense.stage

    @property
    def dp(self):
        return self.dense.dp

    @property
    def clip_grad(self) -> float:
        return self.dense.clip_grad

    @property
    def loss_scaler(self):
        return self.dense.loss_scaler

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.dense.scale_loss(loss)

    def _each(self, method: str, *args) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(getattr(part, method)(*args))
        return stack

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self._each("no_sync")

    def gathered_parameters(self) -> contextlib.AbstractContextManager:
        return self._each("gathered_parameters")

    def states_in_memory(self) -> contextlib.AbstractContextManager:
        return self._each("states_in_memory")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def step(self) -> StepResult:
        return step_together(self.parts, self.loss_scaler, self.clip_grad)

    def parameter_norm(self) -> float:
        return combined_norm([part.master_norm_squared() for part in self.parts])

    def master_pieces(self) -> list[MasterPiece]:
        return [piece for part in self.parts for piece in part.master_pieces()]

    def piece_state(self, piece: MasterPiece, start: int, length: int) -> tuple[dict, dict]:
        return self._part_of[piece.param].piece_state(piece, start, length)

    def load_by_parameter(self, fill: Callable[[MasterPiece, str, torch.Tensor], None], kinds: list[str],
                          scalars: Callable[[MasterPiece], dict] | None = None,
                          loss_scaler: dict | None = None) -> None:
        for part in self.parts:
            part.load_by_parameter(fill, kinds, scalars)
        if loss_scaler is not None:
            self.loss_scaler.load_state_dict(loss_scaler)

    def parameter_shapes(self) -> list[tuple[nn.Parameter, torch.Size]]:
        return [shape for part in self.parts for shape in part.parameter_shapes()]

    def whole_masters(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        for part in self.parts:
            yield from part.whole_masters()

    def masters_to_parameters(self) -> None:
        for part in self.parts:
            part.masters_to_parameters()

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("parts", ())) != len(self.parts):
            raise ValueError("its optimizer parts do not match this model's (another model or layout?)")
        for part, saved in zip(self.parts, state["parts"]):
            part.load_state_dict(saved)

    def model_state_bytes(self) -> int:
        return sum(part.model_state_bytes() for part in self.parts)

    def offloaded_bytes(self) -> int:
        return sum(part.offloaded_bytes() for part in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()
