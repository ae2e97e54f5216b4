"""DP equals brute force; the store dedups and survives reopening."""

import random

import pytest

from partune.core.graph import DataflowGraph
from partune.core.scopes import CompilationConfig
from partune.runners.timing import Measurement
from partune.search.candidates import Candidate
from partune.search.dp import NoCoverError, cheapest_cover, schedulable
from partune.search.rules import RuleContext, rule_for_style
from partune.store.measurements import MeasurementStore
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


def test_store_dedups_and_persists(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    store = MeasurementStore(url, "dev1")
    m = Measurement(1e-3, 1e-5, 1e-3, 5, 10)
    store.put("k1", m, "first")
    store.put("k1", Measurement(2e-3, 0, 2e-3, 5, 10), "again")  # already there: ignored
    store.put("k2", Measurement.failed("boom"))
    assert len(store) == 2 and store.get("k1") == m
    again = MeasurementStore(url, "dev1")
    assert again.get("k1") == m and again.get("k2").error == "boom"
    assert again.get("k2").cost_s == float("inf")
    assert len(again.study.get_trials()) == 2
    assert MeasurementStore(url, "other-device").get("k1") is None


def test_the_in_memory_store_takes_each_key_once_and_keeps_nothing():
    from partune.store.measurements import MEMORY

    store = MeasurementStore(MEMORY, "dev")
    calls = []

    def take() -> Measurement:
        calls.append(1)
        return Measurement(1e-3, 0.0, 1e-3, 1, 1)

    m, took = store.obtain("k", take)
    assert took and store.obtain("k", take) == (m, False) and len(calls) == 1
    claims = store.claims
    assert claims.claim("x") and not claims.claim("x") and claims.holder("x") == claims.owner
    claims.release("x")
    assert claims.holder("x") is None and claims.claim("x")
    claims.done("x")
    claims.release("x")  # a done claim is never given up
    assert claims.is_done("x") and not claims.claim("x")
    assert MeasurementStore(MEMORY, "dev").get("k") is None  # each in-memory store is its own


def test_a_stored_failure_is_retried_once_when_asked(tmp_path):
    from partune.runners.timing import Measurement

    url = f"sqlite:///{tmp_path / 'm.db'}"
    MeasurementStore(url, "dev").put("k", Measurement.failed("machine was busy"))
    calls = []

    def take() -> Measurement:
        calls.append(1)
        return Measurement(1e-3, 0.0, 1e-3, 1, 1, best_s=1e-3)

    assert not MeasurementStore(url, "dev").obtain("k", take)[0].ok  # kept by default
    retrying = MeasurementStore(url, "dev", retry_failed=True)
    m, took = retrying.obtain("k", take)
    assert took and m.ok and retrying.obtain("k", take) == (m, False)
    assert MeasurementStore(url, "dev").get("k").ok and len(calls) == 1  # the latest wins, for everyone
