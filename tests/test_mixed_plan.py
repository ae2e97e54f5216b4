"""Whole models under plans: each backend alone, and all three mixed in one model."""

import pytest

from partune.bench import max_abs_error
from partune.core.plan import Plan, Region, single_backend_plan
from partune.core.scopes import CompilationConfig
from partune.runners.builder import build_plan
from partune.search.candidates import accepted_nodes
from tests.conftest import load_model

CONFIG = CompilationConfig.for_cpu(["torch", "onnxruntime"])


def _scale(model) -> float:
    return max(float(abs(r).max()) for r in model.reference)


@pytest.mark.parametrize("name", ["bert-small", "resnet50-small"])
@pytest.mark.parametrize("backend", ["tvm", "torch", "onnxruntime"])
def test_single_backend_plan_matches_reference(name, backend):
    model = load_model(name)
    accepted = accepted_nodes(model.mod["main"], backend)
    assert len(accepted) == len(model.graph)  # every zoo op has a translation
    plan = single_backend_plan(model.name, model.graph, CONFIG, backend, accepted)
    out = build_plan(plan, model.mod, model.graph)(model.inputs)
    assert max_abs_error(out, model.reference) < 1e-4 * max(1.0, _scale(model))


@pytest.mark.parametrize("name", ["bert-small", "resnet50-small", "gpt2-small"])
@pytest.mark.parametrize("size", [3, 10])
def test_all_three_backends_in_one_model(name, size):
    model = load_model(name)
    order = ["tvm", "torch", "onnxruntime"]
    starts = range(0, len(model.graph), size)
    regions = tuple(
        Region(tuple(range(s, min(s + size, len(model.graph)))), CONFIG.scope_for(order[i % 3]))
        for i, s in enumerate(starts)
    )
    plan = Plan(model.name, model.graph.fingerprint, CONFIG, regions)
    built = build_plan(plan, model.mod, model.graph)
    codegens = {
        f.attrs["Codegen"]
        for gv, f in built.module.functions.items()
        if f.attrs is not None and "Codegen" in f.attrs
    }
    assert codegens == {"partune_torch", "partune_onnxruntime"}
    assert max_abs_error(built(model.inputs), model.reference) < 1e-3


def test_models_built_earlier_keep_their_own_kernels():
    bert, resnet = load_model("bert-small"), load_model("resnet50-small")
    plans = [
        single_backend_plan(
            m.name, m.graph, CONFIG, "torch", accepted_nodes(m.mod["main"], "torch")
        )
        for m in (bert, resnet)
    ]
    first = build_plan(plans[0], bert.mod, bert.graph)
    build_plan(plans[1], resnet.mod, resnet.graph)  # same region numbering, another model
    assert max_abs_error(first(bert.inputs), bert.reference) < 1e-4
