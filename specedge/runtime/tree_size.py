"""How many nodes a tree may have: sized from the measured cost of a T-token target call.

A tree replaces the chain call of k + 1 tokens. Its extra nodes only pay when they cost little:
on a GPU a call of 30 tokens costs about what one of 5 does (decoding is bandwidth-bound), on a
CPU each token is compute. So the tree gets the most nodes whose call the cost model
(`policy.CostModel`, the guard's, measured at load and refined while generating) prices at most
TREE_SLACK above the chain call it replaces: a CPU gets a few branches, a GPU many. A size is
only trusted once measured: the tree grows at most TREE_GROWTH nodes past the largest call
measured so far (without that cap a few noisy timings extrapolated to trees dearer than the
chain call: benchmarks/results/tree/).
"""

from __future__ import annotations

from ..contract import reserved_call_size
from .policy import CostModel

__all__ = ["MAX_TREE_NODES", "TREE_GROWTH", "TREE_SLACK", "tree_nodes"]

# the extra cost a tree call may have over the chain call of k + 1 tokens it replaces
TREE_SLACK = 0.25
# the call every backend's host buffers hold whatever its prefill chunk: no tree grows them
MAX_TREE_NODES = reserved_call_size(0)
# nodes a tree may have beyond the largest call size the cost model has measured
TREE_GROWTH = 2


def tree_nodes(costs: CostModel, k: int, slack: float = TREE_SLACK, limit: int = MAX_TREE_NODES) -> int:
    """Nodes (the root included) of the largest tree whose target call costs at most (1 + slack)
    times the chain call of k + 1 tokens; never fewer than that chain's k + 1."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    budget = (1.0 + slack) * costs.target_cost(k + 1)
    ceiling = min(limit, max([k + 1, *costs.target]) + TREE_GROWTH)
    n = k + 1
    while n < ceiling and costs.target_cost(n + 1) <= budget:
        n += 1
    return n
