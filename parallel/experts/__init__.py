"""Expert parallelism: the groups a mixture-of-experts layer talks over, the token dispatchers that carry
each token to the ranks holding its experts and back, and the grouped product of many experts' weights."""

from parallel.experts.dispatch import (DISPATCHERS, AllGatherDispatcher, AllToAllDispatcher, TokenDispatcher,
                                       gather_rows)
from parallel.experts.grouped_linear import grouped_linear
from parallel.experts.groups import ExpertGroups

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "TokenDispatcher", "ExpertGroups",
           "gather_rows", "grouped_linear"]
