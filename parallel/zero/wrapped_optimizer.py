"""Which torch optimizer steps a ``ZeroOptimizer``'s fp32 masters: the one its factory makes, built over the
masters, where that optimizer is element-wise (AdamW, SGD, ...); Muon (torch's or ours) over the masters
with its matrices orthogonalized whole (``WholeMatrices``); an optimizer that needs whole tensors and has no
such path is refused in one line. Never a factory's optimizer applied to flat shards it cannot step."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from parallel.muon import Muon, settings_of_torch_muon
from parallel.zero.whole_matrices import WholeMatrices

# torch optimizers whose update of an element reads others (row / column statistics, line searches)
NOT_ELEMENT_WISE = ("LBFGS", "Adafactor", "SparseAdam")


class NoParameters:
    """The torch optimizer of a ``ZeroOptimizer`` that holds no parameter on this rank (the expert part on a
    pipeline stage without MoE layers): no state, nothing to step. It never holds a tensor."""

    def __init__(self):
        self.state, self.param_groups = {}, []

    def step(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": self.state, "param_groups": self.param_groups}

    def load_state_dict(self, state: dict) -> None:
        if state["state"] or state["param_groups"]:
            raise ValueError("it holds states of parameters this rank lacks (another model or layout?)")


def optimizer_over_masters(zero, factory: Callable[[list[dict]], torch.optim.Optimizer],
                           param_groups: list[dict], master_groups: list[dict]):
    """The optimizer of ``zero``'s masters (``master_groups``, one per group of ``param_groups``, in order).
    The factory is first shown the model's own groups (copies) to learn which optimizer it makes."""
    held = [group for group in master_groups if group["params"]]
    if not held:  # none here (a pipeline stage without experts): it still joins its groups' collectives
        return NoParameters()
    made = factory(_stand_ins(zero, param_groups))
    if isinstance(made, (Muon, torch.optim.Muon)):
        options = settings_of_torch_muon(made) if isinstance(made, torch.optim.Muon) else \
            [{k: v for k, v in group.items() if k not in ("params", "fused")} for group in made.param_groups]
        muon = Muon([{**options[i], "params": group["params"]} for i, group in enumerate(master_groups)
                     if group["params"]], shards=True)
        muon.distribute(WholeMatrices(zero, muon))
        return muon
    if type(made).__name__ in NOT_ELEMENT_WISE:
        raise ValueError(f"{type(made).__name__} reads whole tensors and ZeRO steps flat shards of them: "
                         "pick an element-wise optimizer (AdamW, SGD, ...) or Muon")
    return factory(held)


def _stand_ins(zero, param_groups: list[dict]) -> list[dict]:
    """Copies of ``param_groups`` for the factory to look at: a stage-3 parameter freed between its gathers
    stands in as a tensor of its whole shape that holds one element (expanded), the others as themselves."""
    shapes = {id(param): shape for param, shape in zero.parameter_shapes()}

    def shown(param: nn.Parameter) -> nn.Parameter:
        shape = shapes.get(id(param), param.shape)
        if param.shape == shape:
            return param
        return nn.Parameter(torch.empty(1, dtype=param.dtype, device=param.device).expand(shape),
                            requires_grad=param.requires_grad)
    return [{**group, "params": [shown(p) for p in group["params"]]} for group in param_groups]


def state_kinds(optimizer, master: nn.Parameter, kinds: list[str]) -> list[str]:
    """Of the per-element states ``kinds`` a checkpoint holds, those ``master`` keeps (Muon keeps its
    momentum for matrices, AdamW's moments for the rest)."""
    if isinstance(optimizer, Muon):
        return [kind for kind in kinds if kind in optimizer.kinds(master)]
    return kinds
