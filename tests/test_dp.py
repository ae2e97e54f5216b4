"""DP equals brute force; the store dedups and survives reopening."""

import random

import pytest

from partune.core.graph import DataflowGraph
from partune.core.scopes import CompilationConfig
from partune.search.candidates import Candidate
from partune.search.dp import NoCoverError, cheapest_cover, schedulable
from partune.search.rules import RuleContext, rule_for_style
from tests.graphs import Attention, Diamond, Residual, TupleGraph


def _candidates(mod):
    g = DataflowGraph.from_function(mod["main"])
    cfg = CompilationConfig.for_cpu(["torch", "onnxruntime"])
    out = []
    for scope, style in zip(cfg.primitives, ("tvm", "none", "arbitrary"), strict=True):
        for p in rule_for_style(style).propose(RuleContext(g, lambda n: True)):
            out.append(Candidate(p.subgraph, scope, p.rule))
    return g, [c for c in out if schedulable(c)]


def _brute_force(g, cands, cost):
    """Cost of every exact cover, enumerated without memo or pruning; the minimum."""
    full = (1 << len(g)) - 1

    def covers(covered):
        if covered == full:
            yield 0.0
            return
        low = (~covered & (covered + 1)).bit_length() - 1
        for c in cands:
            m = c.subgraph.mask
            if m >> low & 1 and not m & covered:
                for rest in covers(covered | m):
                    yield cost(c) + rest

    return min(covers(0))


@pytest.mark.parametrize("mod", [Diamond, Residual, TupleGraph, Attention])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_brute_force(mod, seed):
    g, cands = _candidates(mod)
    rng = random.Random(seed)
    costs = {c: rng.uniform(1, 10) * len(c.subgraph) ** rng.uniform(0.3, 1.2) for c in cands}
    cover = cheapest_cover(g, cands, costs.__getitem__)
    assert cover.cost_s == pytest.approx(_brute_force(g, cands, costs.__getitem__))
    covered = sorted(n for c in cover.candidates for n in c.subgraph.nodes)
    assert covered == list(range(len(g)))


def test_dp_skips_infinite_costs_and_reports_no_cover():
    g, cands = _candidates(Diamond)
    cover = cheapest_cover(g, cands, lambda c: float("inf") if c.backend == "tvm" else 1.0)
    assert all(c.backend != "tvm" for c in cover.candidates)
    with pytest.raises(NoCoverError):
        cheapest_cover(g, cands, lambda c: float("inf") if 3 in c.subgraph else 1.0)
