"""The cheapest covering of the graph by candidates: Dijkstra over covered-node sets.

As in Collage, the search always extends the lowest uncovered node (in post-DFS order)
with a candidate that contains it and overlaps nothing covered. Partune also requires
every input of the candidate to be covered already, so the order the DP picks regions
in is an order the program can run them in: no plan it returns has a cycle.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partune.core import DataflowGraph
from partune.search.candidates import Candidate


def input_mask(c: Candidate) -> int:
    mask = 0
    for p in c.subgraph.inputs:
        mask |= 1 << p
    return mask


def schedulable(c: Candidate) -> bool:
    """Whether the DP can ever pick ``c``: its inputs come before its first node.

    (A candidate with an input inside its own index span could only be picked after a
    candidate that jumped ahead; such candidates are dropped before measuring.)
    """
    first = c.subgraph.nodes[0]
    return all(p < first for p in c.subgraph.inputs)


@dataclass(frozen=True)
class Cover:
    candidates: tuple[Candidate, ...]
    cost_s: float
    states: int  # covered-sets expanded: the DP's work


class NoCoverError(RuntimeError):
    """No combination of (finite-cost) candidates covers the graph."""


def cheapest_per_node_set(
    candidates: Sequence[Candidate], cost: Callable[[Candidate], float]
) -> list[tuple[Candidate, float]]:
    """Per node set, the candidate of finite cost the DP could pick, in ``candidates``' order.

    Candidates covering the same nodes (one per scope) lead to the same DP states, and only the
    cheapest can be on a cheapest path: the first of the cheapest, since the DP replaces a
    state's path only by a strictly cheaper one. The others are left out before the DP: on
    a model of many layers and four backends, most of its candidates. What the DP returns,
    down to its tie-breaks and ``states``, is what it returns with all of them.
    """
    best: dict[int, tuple[int, Candidate, float]] = {}
    for i, c in enumerate(candidates):
        cs = cost(c)
        if cs != float("inf") and ((held := best.get(c.subgraph.mask)) is None or cs < held[2]):
            best[c.subgraph.mask] = (i, c, cs)
    return [(c, cs) for _, c, cs in sorted(best.values(), key=lambda t: t[0])]


def cheapest_cover(
    graph: DataflowGraph, candidates: Sequence[Candidate], cost: Callable[[Candidate], float]
) -> Cover:
    full = (1 << len(graph)) - 1
    by_first: dict[int, list[tuple[Candidate, float, int]]] = {}
    for c, cs in cheapest_per_node_set(candidates, cost):
        # all nodes below u are covered: only c's first node can be u
        by_first.setdefault(c.subgraph.nodes[0], []).append((c, cs, input_mask(c)))
    tie = itertools.count()
    best: dict[int, float] = {0: 0.0}
    back: dict[int, tuple[int, Candidate]] = {}
    heap: list[tuple[float, int, int]] = [(0.0, next(tie), 0)]
    expanded = 0
    while heap:
        so_far, _, covered = heapq.heappop(heap)
        if so_far > best.get(covered, float("inf")):
            continue
        if covered == full:
            picked = []
            while covered:
                covered, c = back[covered]
                picked.append(c)
            return Cover(tuple(reversed(picked)), so_far, expanded)
        expanded += 1
        u = (~covered & (covered + 1)).bit_length() - 1  # lowest uncovered node
        for c, cs, inputs in by_first.get(u, ()):
            m = c.subgraph.mask
            if m & covered or inputs & ~covered:
                continue
            nxt, total = covered | m, so_far + cs
            if total < best.get(nxt, float("inf")):
                best[nxt] = total
                back[nxt] = (covered, c)
                heapq.heappush(heap, (total, next(tie), nxt))
    raise NoCoverError("no combination of measured candidates covers the model")
