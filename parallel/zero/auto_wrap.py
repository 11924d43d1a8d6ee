"""Which modules stage 3 gathers as one unit when the caller names none (FSDP's auto-wrap).

A transformer keeps its blocks in one container (``nn.ModuleList`` or ``nn.Sequential``) of modules of
one class: those are the units. Of several such containers the one holding the most parameters wins
(the layers, not the heads of one attention). Callers may name the unit classes instead.
"""

from __future__ import annotations

from torch import nn


def _numel(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The children of the container of same-class modules with the most parameters (empty if none)."""
    best: list[nn.Module] = []
    for container in module.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and _numel(children) > _numel(best):
            best = children
    return best


def unit_modules(module: nn.Module, units) -> list[nn.Module]:
    """Resolve stage 3's ``unit_modules`` option: a list of modules as given, a class or tuple / set of
    classes (every instance in ``module``), or None (``repeated_blocks``)."""
    if units is None:
        return repeated_blocks(module)
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, (tuple, set, frozenset)) and all(isinstance(u, type) for u in units):
        return [m for m in module.modules() if isinstance(m, tuple(units)) and m is not module]
    return list(units)
