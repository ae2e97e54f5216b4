"""Which regions to auto-tune, and in what order: by expected gain, never a walk over all.

A candidate of an autotuned backend (TVM with MetaSchedule schedules) means nothing until
its region is tuned, and tuning costs tens of seconds per region. So, once every other
candidate is measured, each tunable region gets an expected gain:

    gain = (best other cost of its nodes - estimated tuned cost) x occurrences

The best other cost is the cheapest measured candidate on exactly these nodes (or, when
there is none, the sum of the cheapest single-node ones). The tuned cost is estimated
from the region's untuned TVM cost divided by the speed-up tuning typically brings to
its kind of op (a 256x256 matmul went 15.5 ms -> 0.95 ms; gpt2-small's fused
element-wise glue 3.4-5.1 us -> 2.5-3.1 us: vectorised and unrolled). Occurrences count the regions
of the same structure in the model: one tuning serves them all. Regions are tuned in decreasing gain
while the budget lasts; a region with no expected gain is never tuned. The typical speed-ups are
priors: after each tuned region the search passes what its kind achieved (``achieved``)
and the order is made again, so a kind that tunes worse than expected here (matmul
against MLAS on one core) stops taking the budget from kinds that tune well. The search
then keeps only the regions its DP would use if they tuned as estimated
(``partune.search.collage``): a region the plan cannot take is not worth its tuning time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from partune.core import DataflowGraph, region_key
from partune.search.candidates import Candidate

# What tuning typically buys over TVM's default schedules, per op kind (the region's best).
TYPICAL_SPEEDUP = {
    "matmul": 10.0,
    "nn.conv2d": 10.0,
    "nn.conv1d": 10.0,
    "nn.conv2d_transpose": 10.0,
    "nn.dense": 10.0,
    "nn.attention": 10.0,
    "nn.softmax": 3.0,
    "nn.layer_norm": 3.0,
    "nn.batch_norm": 3.0,
    "nn.rms_norm": 3.0,
    "mean": 3.0,
    "sum": 3.0,
    "max": 3.0,
    "nn.max_pool2d": 3.0,
    "nn.avg_pool2d": 3.0,
}
OTHER_SPEEDUP = 1.4  # element-wise and data movement (measured on gpt2-small's glue)


@dataclass(frozen=True)
class TuningChoice:
    candidate: Candidate  # the autotuned backend's candidate to tune, then measure
    gain_s: float  # expected saving over the best alternative, all occurrences together
    occurrences: int  # regions of this structure in the model (tuned once)
    best_other_s: float
    estimate_s: float  # tuned cost, estimated
    untuned_s: float  # the same nodes under TVM's default schedules (measured)
    kind: str  # the op whose speed-up the estimate used (``anchor_kind``)
    structure: str  # ``region_key``: regions alike in structure share one tuning


def anchor_kind(graph: DataflowGraph, nodes: tuple[int, ...]) -> str:
    """The region's op that tuning is expected to speed up most ("other": element-wise, data
    movement)."""
    known = [graph.nodes[n].op for n in nodes if graph.nodes[n].op in TYPICAL_SPEEDUP]
    return max(known, key=TYPICAL_SPEEDUP.__getitem__, default="other")


def expected_speedup(
    kind: str, achieved: Mapping[str, Sequence[float]] | None = None, optimism: float = 1.0
) -> float:
    """What tuning should bring a region of ``kind`` (``anchor_kind``): its prior, or, once regions
    of that kind were tuned in this run, the geometric mean of the prior and what they achieved
    (measured, untuned / tuned), so a wrong prior is corrected after one or two regions.

    ``optimism`` scales the prior: a long budget (``partune.search.budget``) can afford to
    try regions that would win only if tuning bought more than it usually does; what they
    then achieve pulls the estimate back."""
    prior = TYPICAL_SPEEDUP.get(kind, OTHER_SPEEDUP) * optimism
    seen = [s for s in (achieved or {}).get(kind, ()) if s > 0 and math.isfinite(s)]
    return math.exp(sum(map(math.log, [prior, *seen])) / (1 + len(seen)))


def tuning_order(
    graph: DataflowGraph,
    tunable: list[Candidate],
    others: list[Candidate],
    cost: Callable[[Candidate], float],
    native: str,
    achieved: Mapping[str, Sequence[float]] | None = None,
    optimism: float = 1.0,
) -> list[TuningChoice]:
    """The tunable candidates worth tuning, most expected gain first.

    ``others`` are the measured candidates of every other backend; ``cost`` gives their
    measured cost (inf when not measured or failed); ``native`` is the untuned TVM
    backend whose measurement of the same nodes anchors the estimate; ``achieved`` holds
    the speed-ups measured so far per kind, and ``optimism`` scales the priors
    (``expected_speedup``).
    """
    best: dict[tuple[int, ...], float] = {}
    untuned: dict[tuple[int, ...], float] = {}
    for c in others:
        nodes, x = c.subgraph.nodes, cost(c)
        if c.backend == native:
            untuned[nodes] = min(untuned.get(nodes, math.inf), x)
        else:
            best[nodes] = min(best.get(nodes, math.inf), x)
    single = {
        n[0]: min(best.get(n, math.inf), untuned.get(n, math.inf))
        for n in {*best, *untuned}
        if len(n) == 1
    }
    groups: dict[str, list[Candidate]] = {}
    for c in tunable:
        groups.setdefault(region_key(graph, c.subgraph.nodes), []).append(c)
    out = []
    for structure, members in groups.items():
        c = members[0]
        nodes = c.subgraph.nodes
        kind = anchor_kind(graph, nodes)
        speedup = expected_speedup(kind, achieved, optimism)
        if speedup <= 1.0 or not math.isfinite(untuned.get(nodes, math.inf)):
            continue
        other = best.get(nodes, math.inf)
        if not math.isfinite(other):
            other = sum(single.get(n, math.inf) for n in nodes)
        estimate = untuned[nodes] / speedup
        gain = (min(other, untuned[nodes]) - estimate) * len(members)
        if gain > 0 and math.isfinite(gain):
            out.append(
                TuningChoice(
                    c, gain, len(members), other, estimate, untuned[nodes], kind, structure
                )
            )
    return sorted(out, key=lambda t: -t.gain_s)
