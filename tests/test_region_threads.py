"""Regions on fewer threads than the job's (``SEScope.threads``).

On many cores a small region, or a small model, runs faster on one thread than split over
several (each op pays to wake and join a pool); a library that keeps a thread count per
compiled region (onnxruntime, OpenVINO) is offered a one-thread twin of its scopes. Scopes,
keys and plans on the job's threads must read exactly as before.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from partune.backends import registry
from partune.core.describe import scope_name, variant_label
from partune.core.keys import candidate_key
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig, ScopeError, SEScope
from partune.runners.local import LocalRunner
from partune.search.candidates import accepted_nodes, enumerate_candidates
from partune.search.collage import tune
from partune.search.options import TuneOptions
from partune.search.refine import search_space
from partune.search.session import SearchSession
from partune.store.measurements import MEMORY, MeasurementStore
from tests.test_precision import _Model

LIBRARIES = ["onnxruntime", "openvino"]


def test_one_thread_twins_only_on_many_threads_and_only_for_libraries_that_keep_their_own():
    names = registry.threads_per_region_names(["tvm", "torch", *LIBRARIES])
    assert names == tuple(LIBRARIES)  # TVM's and torch's pools are one per process
    many = CompilationConfig.for_cpu(["tvm", *LIBRARIES], 2, one_thread=names)
    assert {s.choice for s in many.primitives if s.threads} == {"onnxruntime/1t", "openvino/1t"}
    assert many.variants == (("f32", None), ("f32", 1))
    assert CompilationConfig.for_cpu(["tvm", *LIBRARIES], 1, one_thread=names).variants == (
        ("f32", None),
    )
    # The job's own scopes are untouched: same JSON, same keys, as without the twins.
    plain = CompilationConfig.for_cpu(["tvm", *LIBRARIES], 2)
    for b in LIBRARIES:
        assert many.scope_for(b) == plain.scope_for(b)
        assert "threads" not in many.scope_for(b).to_json()
        assert many.scope_for(b, threads=1).to_json()["threads"] == 1
        graph = _Model.graph
        assert candidate_key(graph, (0, 1), many.scope_for(b)) == candidate_key(
            graph, (0, 1), plain.scope_for(b)
        )
        assert candidate_key(graph, (0, 1), many.scope_for(b, threads=1)) != candidate_key(
            graph, (0, 1), plain.scope_for(b)
        )
    one = many.scope_for("openvino", threads=1)
    assert SEScope.from_json(one.to_json()) == one and many.scope_named(one.choice) == one
    assert str(one).endswith("/1t") and scope_name(one) == "openvino 1 thread"
    assert variant_label("bf16", 1) == " (bf16, 1 thread)" and variant_label("f32", None) == ""
    with pytest.raises(ScopeError, match="positive integer"):
        SEScope("cpu", 0, None, "global", "onnxruntime", threads=0)


def test_twins_compete_whole_and_in_refinement_not_per_candidate():
    config = CompilationConfig.for_cpu(["tvm", "onnxruntime"], 2, one_thread=("onnxruntime",))
    cands = enumerate_candidates(_Model.mod, _Model.graph, config)
    assert cands and not any(c.scope.threads for c in cands)
    accepted = {b: accepted_nodes(_Model.mod["main"], b) for b in config.backends}
    plan = single_backend_plan("mlp", _Model.graph, config, "onnxruntime", accepted["onnxruntime"])
    assert all("onnxruntime/1t" in moves for moves in search_space(plan, config, accepted))


@pytest.mark.parametrize("backend", LIBRARIES)
def test_a_one_thread_region_runs_on_one_thread(backend):
    from dataclasses import replace

    from partune.runners.builder import region_request
    from partune.runners.worker import build_region

    config = CompilationConfig.for_cpu(["tvm", backend], 2, one_thread=(backend,))
    nodes = tuple(range(len(_Model.graph)))
    for scope, want in ((config.scope_for(backend), 2), (config.scope_for(backend, threads=1), 1)):
        req = replace(region_request(_Model.mod, _Model.graph, nodes, scope), threads=2)
        _, kernel, _ = build_region(req)
        if want == 1 or backend == "onnxruntime":
            assert _threads_of(kernel) == want
        else:  # OpenVINO caps the count at the cores this process may use (tests may pin it to one)
            assert 1 <= _threads_of(kernel) <= 2


def _threads_of(kernel) -> int:
    if hasattr(kernel, "session"):  # onnxruntime
        return kernel.session.get_session_options().intra_op_num_threads
    return int(kernel.compiled.get_property("INFERENCE_NUM_THREADS"))  # openvino


def test_a_search_on_two_threads_offers_and_deploys_one_thread_plans(tmp_path):
    from partune import deployed
    from partune.export import export

    store = MeasurementStore(MEMORY, "test-device")
    with LocalRunner(timeout_s=120, threads=2) as runner:
        result = tune(_Model(), ["tvm", "onnxruntime"], runner, store, threads=2, peers=())
    one = result.plans["onnxruntime-only (1 thread)"]
    assert {r.scope.threads for r in one.regions if r.backend == "onnxruntime"} == {1}
    assert result.end_to_end["onnxruntime-only (1 thread)"].ok
    assert "onnxruntime-only" in result.end_to_end  # the job's own thread count competes too
    # Switched off, no scope runs on fewer threads: no candidate, and no single-library plan, has
    # one.
    off = SearchSession(
        _Model(),
        ["tvm", "onnxruntime"],
        runner,
        MeasurementStore(MEMORY, "other"),
        TuneOptions(threads=2, peers=(), one_thread_regions=False),
    )
    assert not any(s.threads for s in off.config.primitives) and not any(
        c.scope.threads for c in off.cands
    )
    out = export(_Model(), one, tmp_path / "deploy", threads=2)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {r.get("threads") for r in manifest["regions"] if r["backend"] == "onnxruntime"} == {1}
    got = deployed.load(out)(*_Model.inputs)
    np.testing.assert_allclose(np.asarray(got[0]), _Model().reference[0], rtol=1e-4, atol=1e-4)
