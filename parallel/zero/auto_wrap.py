"""Which modules stage 3 gathers as one unit (FSDP's auto-wrap when the caller names none), and which
parameters each unit holds.

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


def group_units(module: nn.Module, unit_modules: list[nn.Module], param_groups: list[dict],
                sharded) -> list[tuple[str, nn.Module, list[nn.Parameter], int]]:
    """(name, module, params, group) per unit: the ``sharded`` parameters by innermost unit module (the
    rest belong to ``module``), optimizer group and dtype."""
    owners = [module] + [m for m in unit_modules if m is not module]
    names = {m: name or "model" for name, m in module.named_modules()}
    owner_of = {}
    for owner in owners:  # later (inner) owners overwrite outer ones
        for param in owner.parameters():
            owner_of[param] = owner
    units = []
    for owner in owners:
        for group_index, group in enumerate(param_groups):
            mine = [p for p in group["params"] if sharded(p) and owner_of.get(p) is owner]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                units.append((names.get(owner, type(owner).__name__), owner,
                              [p for p in mine if p.dtype == dtype], group_index))
    return units
