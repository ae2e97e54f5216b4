"""Second-level search over plan variants (the measuring function is the test's own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from partune.core.graph import DataflowGraph
from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig
from partune.runners.timing import Measurement
from partune.search.refine import refine, variant
from tests.graphs import Diamond

CONFIG = CompilationConfig.for_cpu(["tvm", "onnxruntime"])
GRAPH = DataflowGraph.from_function(Diamond["main"])  # relu -> (exp, tanh) -> add
BASE = Plan(
    "diamond",
    GRAPH.fingerprint,
    CONFIG,
    tuple(Region((n,), CONFIG.scope_for("tvm")) for n in range(4)),
)
ROOT = Path(__file__).resolve().parent.parent
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
    assert [r.nodes for r in seen[0].regions] == [
        r.nodes for r in BASE.regions
    ]  # the DP plan first
    assert out is not None and out.measurement.cost_s <= _cost(BASE)
    # The seed "all to onnxruntime, merged" is the planted optimum: one region.
    assert len(out.plan.regions) == 1 and out.plan.regions[0].backend == "onnxruntime"


def test_a_resumed_refinement_measures_nothing_new(storage_url):
    storage = optuna.storages.RDBStorage(storage_url)
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
    base = Plan(
        "diamond",
        GRAPH.fingerprint,
        CONFIG,
        tuple(Region((n,), CONFIG.scope_for("tvm")) for n in (0, 3, 1, 2)),
    )
    params = {f"r{i}": "onnxruntime" for i in range(4)} | {"merge1": True}
    plan = variant(GRAPH, base, CONFIG, params)
    assert plan is not None and all(r.nodes != (0, 3) for r in plan.regions)
    merged = variant(
        GRAPH, BASE, CONFIG, {f"r{i}": "onnxruntime" for i in range(4)} | {"merge1": True}
    )
    assert merged is not None and merged.regions[0].nodes == (0, 1)  # neighbours in order do merge


def _worker(url: str, log, n: int, slow_at: int = -1) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.refine_worker",
            url,
            "shared",
            str(n),
            str(log),
            str(slow_at),
        ],
        cwd=ROOT,
    )


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="shared", storage=url).get_trials(deepcopy=False)


def test_two_workers_share_one_study_with_no_duplicate_work(tmp_path):
    url, log = f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "taken.log"
    workers = [_worker(url, log, 10) for _ in range(2)]
    assert [w.wait(timeout=180) for w in workers] == [0, 0]
    trials = _trials(url)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert (
        10 <= len(done) <= 11
    )  # the budget, shared (each worker may start one last trial at once)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    taken = [ln.split() for ln in log.read_text().splitlines()]
    keys = [k for _, k in taken]
    assert len(keys) == len(set(keys))  # no plan measured twice, whichever worker proposed it
    assert len({t.user_attrs["worker"] for t in done}) == 2  # both workers ran trials


def test_a_killed_workers_trial_is_failed_and_retried(tmp_path):
    url, log = f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "taken.log"
    doomed = _worker(url, log, 6, slow_at=2)
    deadline = time.monotonic() + 120
    while "SLOW" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and doomed.poll() is None
        time.sleep(0.2)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    killed = [t for t in _trials(url) if t.state == TrialState.RUNNING]
    assert len(killed) == 1  # the zombie the kill left
    assert _worker(url, log, 6).wait(timeout=180) == 0
    trials = _trials(url)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert trials[killed[0].number].state == TrialState.FAIL
    retries = [
        t
        for t in trials
        if RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == killed[0].number
    ]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].params == killed[0].params


def test_latency_and_memory_give_a_pareto_front():
    storage = optuna.storages.InMemoryStorage()

    def measure(plan: Plan) -> Measurement:
        c = _cost(plan)  # a made-up trade-off: more onnxruntime nodes, faster but heavier
        ort = sum(len(r.nodes) for r in plan.regions if r.backend == "onnxruntime")
        return Measurement(c, 0.0, c, 1, 1, best_s=c, peak_bytes=(1 + ort) * 2**20)

    out = refine(GRAPH, BASE, CONFIG, ACCEPTED, measure, storage, "pareto", 16, memory=True)
    assert out is not None and len(out.front) >= 2
    points = [(m.cost_s, m.peak_bytes) for _, m in out.front]
    assert points == sorted(points)  # fastest first
    assert out.front[0][1].cost_s == out.measurement.cost_s
    for i, (t, b) in enumerate(points):  # nobody on the front dominates another
        assert not any(
            t2 <= t and b2 <= b and (t2, b2) != (t, b)
            for j, (t2, b2) in enumerate(points)
            if j != i
        )
    assert all(
        b2 < b for (_, b), (_, b2) in zip(points, points[1:], strict=False)
    )  # slower means leaner


def test_with_patience_refinement_stops_once_no_variant_is_faster():
    """Unbounded trials: the study stops itself once PATIENCE trials in a row found nothing
    faster (the planted optimum is a seed, so every later trial is no gain)."""
    from partune.search.budget import PATIENCE

    storage = optuna.storages.InMemoryStorage()
    seen: list[Plan] = []

    def measure(plan: Plan) -> Measurement:
        seen.append(plan)
        c = _cost(plan)
        return Measurement(c, 0.0, c, 1, 1, best_s=c)

    out = refine(GRAPH, BASE, CONFIG, ACCEPTED, measure, storage, "p", 10_000, patience=PATIENCE)
    assert out is not None and out.converged and len(out.plan.regions) == 1
    values = [
        t.values[0] if t.values else float("inf")
        for t in optuna.load_study(study_name="p", storage=storage).get_trials(
            states=(TrialState.COMPLETE, TrialState.PRUNED)
        )
    ]
    best_at = values.index(min(values))
    assert len(values) == best_at + 1 + PATIENCE  # stopped exactly PATIENCE trials after the best
    # Without patience the same study would go on to the trial budget.
    more = refine(GRAPH, BASE, CONFIG, ACCEPTED, measure, storage, "p", len(values) + 3)
    assert more is not None and not more.converged and more.trials == len(values) + 3


def test_a_deadline_stops_unbounded_refinement():
    storage = optuna.storages.InMemoryStorage()

    def measure(plan: Plan) -> Measurement:
        time.sleep(0.05)
        c = _cost(plan)
        seen.append(plan)
        return Measurement(c, 0.0, c, 1, 1, best_s=c)

    seen: list[Plan] = []
    start = time.monotonic()
    out = refine(
        GRAPH,
        BASE,
        CONFIG,
        ACCEPTED,
        measure,
        storage,
        "d",
        10_000,
        deadline=start + 1.0,
        patience=10_000,
    )
    assert out is not None and not out.converged
    assert time.monotonic() - start < 3.0 and 5 < len(seen) < 60
