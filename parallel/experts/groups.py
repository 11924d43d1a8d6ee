"""The groups one mixture-of-experts layer talks over, cut from a run's dense and expert grids."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.comm import AxisGroup, DetachedGroup
from parallel.process_groups import ParallelGroups


@dataclass(frozen=True)
class ExpertGroups:
    """``tokens`` (tp x cp: the ranks that hold parts of the same sequences, whose token counts the balancing
    losses and capacity see together), ``etp`` (ranks holding slices of the same experts), ``ep`` (ranks
    holding different experts) and ``dispatch`` (etp x ep: the ranks a layer's tokens are exchanged among).

    Owns handles only; it never creates a group and never communicates.
    """

    tokens: AxisGroup
    etp: AxisGroup
    ep: AxisGroup
    dispatch: AxisGroup

    @classmethod
    def of(cls, groups: ParallelGroups) -> ExpertGroups:
        return cls(groups.tp_cp, groups.etp, groups.ep, groups.etp_ep)

    @classmethod
    def detached(cls, ep: int = 1, etp: int = 1, tokens: int = 1) -> ExpertGroups:
        """Groups of these sizes with no processes behind them, seen from their first rank: enough to build
        a layer on the meta device (counting) or alone in one process (all sizes 1)."""
        return cls(DetachedGroup("tp-cp", tokens), DetachedGroup("etp", etp), DetachedGroup("ep", ep),
                   DetachedGroup("etp-ep", etp * ep))
