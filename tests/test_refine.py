"""Second-level search over plan variants (the measuring function is the test's own)."""

from __future__ import annotations

import optuna

from runners.timing import Measurement
from search.graph import DataflowGraph
from search.plan import Plan, Region
from search.refine import refine, variant
from search.scopes import CompilationConfig
from tests.graphs import Diamond

CONFIG = CompilationConfig.for_cpu(["tvm", "onnxruntime"])
GRAPH = DataflowGraph.from_function(Diamond["main"])  # relu -> (exp, tanh) -> add
BASE = Plan("diamond", GRAPH.fingerprint, CONFIG, tuple(
    Region((n,), CONFIG.scope_for("tvm")) for n in range(4)))
ACCEPTED = {"tvm": {0, 1, 2, 3}, "onnxruntime": {0, 1, 2, 3}}


def _cost(plan: Plan) -> float:
    """A made-up cost with a known optimum: one onnxruntime region for everything."""
    ort = sum(len(r.nodes) for r in plan.regions if r.backend == "onnxruntime")
    return 1e-3 * (len(plan.regions) + 2 * (4 - ort) * (ort > 0)) + (1e-4 if ort == 0 else 0)


def _run(storage, name, trials, seen):
    def measure(plan: Plan) -> Measurement:
        seen.append(plan)
        c = _cost(plan)
        return Measurement(c, 0.0, c, 1, 1, best_s=c)

    return refine(GRAPH, BASE, CONFIG, ACCEPTED, measure, storage, name, trials)


def test_refinement_starts_from_the_dp_plan_and_never_returns_worse():
    storage = optuna.storages.InMemoryStorage()
    seen: list[Plan] = []
    out = _run(storage, "r", 8, seen)
    assert [r.nodes for r in seen[0].regions] == [r.nodes for r in BASE.regions]  # the DP plan first
    assert out is not None and out.measurement.cost_s <= _cost(BASE)
    # The seed "all to onnxruntime, merged" is the planted optimum: one region.
    assert len(out.plan.regions) == 1 and out.plan.regions[0].backend == "onnxruntime"


def test_a_resumed_refinement_measures_nothing_new(tmp_path):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'r.db'}")
    first: list[Plan] = []
    a = _run(storage, "r", 6, first)
    again: list[Plan] = []
    b = _run(storage, "r", 6, again)
    assert a is not None and b is not None and b.trials == a.trials
    assert len(again) <= 1  # at most the best one, rebuilt and answered from the caller's store
    assert [r.nodes for r in b.plan.regions] == [r.nodes for r in a.plan.regions]


def test_merges_that_would_break_convexity_are_not_made():
    # Regions listed relu, add, exp, tanh: merging relu with add would leave exp and tanh
    # outside a path that goes out of the region and back in.
    base = Plan("diamond", GRAPH.fingerprint, CONFIG, tuple(
        Region((n,), CONFIG.scope_for("tvm")) for n in (0, 3, 1, 2)))
    params = {f"r{i}": "onnxruntime" for i in range(4)} | {"merge1": True}
    plan = variant(GRAPH, base, CONFIG, params)
    assert plan is not None and all(r.nodes != (0, 3) for r in plan.regions)
    merged = variant(GRAPH, BASE, CONFIG, {f"r{i}": "onnxruntime" for i in range(4)} | {"merge1": True})
    assert merged is not None and merged.regions[0].nodes == (0, 1)  # neighbours in order do merge
