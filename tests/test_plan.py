import json

import pytest

from partune.core.errors import PlanError
from partune.core.plan import Plan, Region, contiguous_runs, region_order, single_backend_plan
from partune.core.scopes import CompilationConfig

BACKENDS = ("tvm", "torch", "onnxruntime")


@pytest.fixture(scope="module")
def config():
    return CompilationConfig.for_cpu(["torch", "onnxruntime"])


def _plan(model, config, regions):
    return Plan(model.name, model.graph.fingerprint, config, tuple(regions))


def test_json_round_trip(bert, config, tmp_path):
    plan = single_backend_plan(
        bert.name, bert.graph, config, "torch", set(range(0, len(bert.graph), 2))
    )
    plan = Plan(
        plan.model,
        plan.fingerprint,
        plan.config,
        tuple(Region(r.nodes, r.scope, 1e-4 * i) for i, r in enumerate(plan.regions)),
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.estimated_cost_s() == pytest.approx(plan.estimated_cost_s())
    assert json.loads(path.read_text())["format"] == "partune-plan/1"
    again.validate(bert.graph, BACKENDS)


def test_single_backend_plan_covers_everything_once(bert, config):
    accepted = {i for i in range(len(bert.graph)) if i % 3}
    plan = single_backend_plan(bert.name, bert.graph, config, "torch", accepted)
    plan.validate(bert.graph, BACKENDS)
    for r in plan.regions:
        assert (r.backend == "torch") == (r.nodes[0] in accepted)


def test_contiguous_runs():
    assert contiguous_runs([5, 1, 2, 3, 7, 8]) == [(1, 2, 3), (5,), (7, 8)]
    assert contiguous_runs([]) == []


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p, n: Plan(p.model, "0" * 16, p.config, p.regions), "another model"),
        (lambda p, n: Plan(p.model, p.fingerprint, p.config, p.regions[:-1]), "uncovered"),
        (
            lambda p, n: Plan(
                p.model, p.fingerprint, p.config, (*p.regions, Region((0,), p.regions[0].scope))
            ),
            "in two regions",
        ),
        (
            lambda p, n: Plan(
                p.model, p.fingerprint, p.config, (*p.regions, Region((n + 4,), p.regions[0].scope))
            ),
            "names node",
        ),
    ],
)
def test_bad_plans_are_refused(bert, config, mutate, match):
    plan = single_backend_plan(bert.name, bert.graph, config, "tvm", set())
    with pytest.raises(PlanError, match=match):
        mutate(plan, len(bert.graph)).validate(bert.graph, BACKENDS)


def test_unknown_backend_in_plan(bert, config):
    data = single_backend_plan(bert.name, bert.graph, config, "tvm", set()).to_json()
    data["regions"][0]["scope"]["backend"] = "tensorrt"
    with pytest.raises(PlanError, match="unknown backend 'tensorrt'"):
        Plan.from_json(data).validate(bert.graph, BACKENDS)


def test_non_convex_regions_are_refused(bert, config):
    # Node 1 depends on node 0 and something of node 0's region depends on node 1.
    g = bert.graph
    edge = next(
        (p, n.index)
        for n in g.nodes
        for p in n.inputs
        if any(c > n.index for c in g.consumers[n.index])
    )
    a, b = edge
    later = next(c for c in g.consumers[b] if c > b)
    torch_scope, tvm_scope = config.scope_for("torch"), config.scope_for("tvm")
    regions = [
        Region((a, later), torch_scope),
        *[Region((i,), tvm_scope) for i in range(len(g)) if i not in (a, later)],
    ]
    with pytest.raises(PlanError, match="cycle"):
        region_order(g, tuple(regions))


def test_malformed_plan_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        Plan.load(p)
    p.write_text('{"format": "something-else"}')
    with pytest.raises(PlanError, match="not a Partune plan"):
        Plan.load(p)
    p.write_text('{"format": "partune-plan/1", "model": "m"}')
    with pytest.raises(PlanError, match="malformed plan"):
        Plan.load(p)
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.load(tmp_path / "missing.json")
