"""Auto-tuning inside the search: which regions get tuned, and a tuned region winning the DP."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from partune.core.graph import DataflowGraph
from partune.core.scopes import SEScope
from partune.core.subgraph import SubGraph
from partune.runners.local import LocalRunner
from partune.runners.timing import Measurement
from partune.search.candidates import Candidate
from partune.search.collage import tune
from partune.search.tuning import tuning_order
from partune.store.measurements import MeasurementStore
from tests.graphs import Residual


def _cand(graph, nodes, backend) -> Candidate:
    return Candidate(SubGraph.of(graph, nodes), SEScope(backend=backend), "test")


def test_only_regions_with_an_expected_gain_are_tuned_most_gain_first():
    g = DataflowGraph.from_function(Residual["main"])  # conv2d -> relu -> add -> sum
    tunable = [
        _cand(g, (0, 1), "tvm-tuned"),
        _cand(g, (2,), "tvm-tuned"),
        _cand(g, (3,), "tvm-tuned"),
    ]
    others = [
        _cand(g, (0, 1), "tvm"),
        _cand(g, (0, 1), "onnxruntime"),
        _cand(g, (2,), "tvm"),
        _cand(g, (2,), "onnxruntime"),
        _cand(g, (3,), "tvm"),
        _cand(g, (3,), "onnxruntime"),
    ]
    cost = {
        (0, 1, "tvm"): 100e-6,
        (0, 1, "onnxruntime"): 20e-6,  # conv: tuned ~10 us would beat 20
        (2, "tvm"): 1.4e-6,
        (2, "onnxruntime"): 3e-6,  # an add, already TVM's: ~0.4 us to win
        (3, "tvm"): 12e-6,
        (3, "onnxruntime"): 3e-6,
    }  # a sum: tuned ~4 us, still loses to 3
    order = tuning_order(g, tunable, others, lambda c: cost[(*c.subgraph.nodes, c.backend)], "tvm")
    assert [c.candidate.subgraph.nodes for c in order] == [(0, 1), (2,)]
    assert math.isclose(order[0].gain_s, 20e-6 - 10e-6) and order[0].best_other_s == 20e-6
    assert math.isclose(order[1].gain_s, 1.4e-6 - 1e-6)


def test_a_long_budget_also_tries_what_would_win_only_if_tuning_went_well():
    """The sum (12 us untuned, 3 us elsewhere) wins only if tuning buys 4x, not the usual 3x:
    a 90-minute budget's optimism (1.7) tries it; what it achieves then corrects the hope."""
    from partune.search.budget import Budget

    g = DataflowGraph.from_function(Residual["main"])  # conv2d -> relu -> add -> sum
    tunable, others = (
        [_cand(g, (3,), "tvm-tuned")],
        [_cand(g, (3,), "tvm"), _cand(g, (3,), "onnxruntime")],
    )
    cost = {(3, "tvm"): 12e-6, (3, "onnxruntime"): 3e-6}

    def order(optimism, achieved=None):
        return tuning_order(
            g,
            tunable,
            others,
            lambda c: cost[(*c.subgraph.nodes, c.backend)],
            "tvm",
            achieved,
            optimism,
        )

    assert Budget.of(1800).optimism == 1.0 and not order(Budget.of(1800).optimism)
    hope = Budget.of(5400).optimism
    assert 1.7 < hope < 1.8 and [t.candidate.subgraph.nodes for t in order(hope)] == [(3,)]
    assert not order(hope, {"sum": [1.5]})  # tuned sums came out 1.5x here: the hope is gone


def test_a_kind_that_tuned_badly_here_stops_taking_the_budget():
    g = DataflowGraph.from_function(Residual["main"])  # conv2d -> relu -> add -> sum
    tunable = [_cand(g, (0, 1), "tvm-tuned"), _cand(g, (2,), "tvm-tuned")]
    others = [
        _cand(g, (0, 1), "tvm"),
        _cand(g, (0, 1), "onnxruntime"),
        _cand(g, (2,), "tvm"),
        _cand(g, (2,), "onnxruntime"),
    ]
    cost = {
        (0, 1, "tvm"): 100e-6,
        (0, 1, "onnxruntime"): 20e-6,
        (2, "tvm"): 1.4e-6,
        (2, "onnxruntime"): 3e-6,
    }

    def order(achieved=None):
        return tuning_order(
            g, tunable, others, lambda c: cost[(*c.subgraph.nodes, c.backend)], "tvm", achieved
        )

    first = order()
    assert (
        first[0].kind == "nn.conv2d" and first[0].untuned_s == 100e-6 and first[1].kind == "other"
    )
    # Convolutions tuned here came out only 2x faster, not 10x: sqrt(10 * 2) = 4.5x expected,
    # 100 / 4.5 = 22 us > 20 us elsewhere: no gain left, the add goes first (and alone).
    assert [t.kind for t in order({"nn.conv2d": [2.0]})] == ["other"]
    # Glue that tuned 4x here is expected to gain more than the prior's 1.4x said.
    better = order({"other": [4.0]})
    glue = next(t for t in better if t.kind == "other")
    assert math.isclose(glue.estimate_s, 1.4e-6 / math.sqrt(1.4 * 4.0))
    assert glue.gain_s > next(t for t in first if t.kind == "other").gain_s


def _matmul_model(n: int = 256):
    """One matmul + relu with a constant weight: untuned TVM is far from what tuning gets."""
    x = relax.Var("x", relax.TensorType((n, n), "float32"))
    w = relax.const(np.random.default_rng(0).standard_normal((n, n)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    mod = bb.get()

    class Model:
        name = "matmul256"
        graph = DataflowGraph.from_function(mod["main"])
        inputs = [np.random.default_rng(1).standard_normal((n, n)).astype("float32")]
        torch_module = onnx_bytes = None

    Model.mod = tvm.IRModule({"main": mod["main"]})
    return Model()


def test_a_tuned_region_wins_the_dp_and_a_rerun_tunes_nothing(tmp_path, backend_settings):
    backend_settings(tuning_database=str(tmp_path / "tuning"))
    model = _matmul_model()
    store = MeasurementStore(f"sqlite:///{tmp_path / 'm.db'}", "test-device")
    with LocalRunner(timeout_s=300) as runner:
        first = tune(
            model, ["tvm", "tvm-tuned"], runner, store, peers=(), tune_budget_s=240, tune_trials=16
        )
        again = tune(
            model, ["tvm", "tvm-tuned"], runner, store, peers=(), tune_budget_s=240, tune_trials=16
        )
    assert first.tuning.regions >= 1 and first.tuning.trials > 0
    assert "tvm-tuned" in first.dp_plan.backends  # it measured faster than untuned TVM
    # A tuned region keeps its borders in the whole-model build (partune.core.partition), so the
    # DP plan runs the workloads that were tuned: end to end it beats untuned TVM.
    assert first.end_to_end[first.dp_label].cost_s < first.end_to_end["tvm-only"].cost_s
    judged = {label: m.median_s for label, m in first.verdict.measurements.items() if m.ok}
    assert first.plan.notes["chosen_as"] == min(judged, key=judged.get)
    assert (
        again.tuning.trials == 0 and again.counts.measured == 0
    )  # records and measurements reused
    assert "tvm-tuned" in again.plan.backends


def test_a_tuned_region_is_fused_alone_in_the_whole_model_build():
    """Tuned matmul + untuned relu: TVM must not fuse them into a workload never tuned."""
    from partune.backends.tvm_backend import lower_fused
    from partune.core.plan import Plan, Region
    from partune.core.scopes import CompilationConfig
    from partune.runners.builder import partition_plan

    model = _matmul_model(16)
    config = CompilationConfig.for_cpu(["tvm", "tvm-tuned"], 1)
    scope = {s.backend: s for s in config.primitives}

    def fused_names(plan_backends: tuple[str, str]) -> list[str]:
        regions = tuple(Region((i,), scope[b]) for i, b in enumerate(plan_backends))
        plan = Plan(model.name, model.graph.fingerprint, config, regions)
        lowered = lower_fused(
            partition_plan(plan, model.mod, model.graph, "t"), scope["tvm"].tvm_target()
        )
        return [
            gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
        ]

    assert any(
        "matmul" in n and "relu" in n for n in fused_names(("tvm", "tvm"))
    )  # fused when both untuned
    names = fused_names(("tvm-tuned", "tvm"))
    assert not any("matmul" in n and "relu" in n for n in names), names
    assert any("matmul" in n for n in names) and any("relu" in n for n in names)


def test_what_tuning_achieved_on_this_store_before_starts_the_priors():
    """A later run (a longer budget) reads untuned / tuned of the regions tuned before: a kind
    that tuned badly here is not tried again on the usual prior."""
    from types import SimpleNamespace

    from partune.search.autotune import achieved_before

    g = DataflowGraph.from_function(Residual["main"])  # conv2d -> relu -> add -> sum
    tunable = [_cand(g, (0, 1), "tvm-tuned"), _cand(g, (3,), "tvm-tuned")]
    others = [_cand(g, (0, 1), "tvm"), _cand(g, (3,), "tvm"), _cand(g, (3,), "onnxruntime")]
    keys = {c: f"k{c.subgraph.nodes}{c.backend}" for c in tunable + others}

    def took(seconds: float) -> Measurement:
        return Measurement(seconds, 0.0, seconds, 1, 1, best_s=seconds)

    stored = {
        keys[others[0]]: took(100e-6),
        f"{keys[tunable[0]]}:tuned32": took(50e-6),
        keys[others[1]]: took(12e-6),
    }  # the sum was never tuned: nothing known of it
    s = SimpleNamespace(
        graph=g,
        keys=keys,
        store=SimpleNamespace(get=stored.get),
        config=SimpleNamespace(default=SimpleNamespace(backend="tvm")),
        options=SimpleNamespace(tune_trials=32),
    )
    structure = {c: f"s{c.subgraph.nodes}" for c in tunable}
    assert achieved_before(s, tunable, others, structure) == {"s(0, 1)": ("nn.conv2d", 2.0)}
    s.options.tune_trials = (
        64  # a larger --tune-trials tunes further: what 32 trials did is not its answer
    )
    assert achieved_before(s, tunable, others, structure) == {}
