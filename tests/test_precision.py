"""bf16 regions: precision in the SEScope, the accuracy budget, and bf16 plans deployed.

f32 must read exactly as before precision existed (keys and plan JSON); a bf16 plan is
only ever chosen within the user's --tolerance, judged on whole plans.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from partune.backends import registry
from partune.core.graph import DataflowGraph
from partune.core.keys import candidate_key
from partune.core.plan import Plan, Region, single_backend_plan
from partune.core.scopes import CompilationConfig, ScopeError, SEScope, cpu_target
from partune.runners.accuracy import f32_twin, has_reduced, held_out_inputs, relative_error
from partune.runners.local import LocalRunner
from partune.runners.timing import Measurement
from partune.search.candidates import accepted_nodes
from partune.search.collage import tune
from partune.search.precision import budgeted, worth_repairing
from partune.store.measurements import MEMORY, MeasurementStore

needs_bf16 = pytest.mark.skipif(
    not registry.cpu_has_bf16(),
    reason="this CPU reports no bf16 instructions: bf16 is not offered here",
)


@I.ir_module
class Mlp:
    @R.function
    def main(
        x: R.Tensor((32, 256), "float32"),
        w1: R.Tensor((256, 512), "float32"),
        w2: R.Tensor((512, 256), "float32"),
    ):
        with R.dataflow():
            a = R.matmul(x, w1)
            b = R.nn.gelu(a)
            c = R.matmul(b, w2)
            d = R.nn.relu(c)
            R.output(d)
        return d


class _Model:
    name = "mlp"
    mod = Mlp
    graph = DataflowGraph.from_function(Mlp["main"])
    rng = np.random.default_rng(0)
    inputs = [
        rng.standard_normal((32, 256)).astype("float32"),
        (rng.standard_normal((256, 512)) / 16).astype("float32"),
        (rng.standard_normal((512, 256)) / 22).astype("float32"),
    ]
    torch_module = None
    onnx_bytes = None
    pins: dict = {}
    reference_source = "numpy (float64)"

    @property
    def reference(self) -> list[np.ndarray]:
        from math import erf

        x, w1, w2 = (a.astype(np.float64) for a in self.inputs)
        a = x @ w1
        return [
            np.maximum((0.5 * a * (1 + np.vectorize(erf)(a / np.sqrt(2)))) @ w2, 0).astype(
                "float32"
            )
        ]


# -- the scope -----------------------------------------------------------------------


def test_f32_scopes_read_as_before_and_bf16_is_its_own_scope():
    f32 = SEScope("cpu", 0, {"kind": "llvm"}, "global", "openvino")
    assert (
        "precision" not in f32.to_json() and SEScope(**{**f32.to_json(), "precision": "f32"}) == f32
    )
    bf16 = SEScope("cpu", 0, {"kind": "llvm"}, "global", "openvino", "bf16")
    assert bf16 != f32 and SEScope.from_json(bf16.to_json()) == bf16 and str(bf16).endswith("/bf16")
    g = _Model.graph
    assert candidate_key(g, (0,), bf16) != candidate_key(g, (0,), f32)
    # Unset precision is unconstrained when scopes join (a pin to a backend allows either).
    assert (
        SEScope(backend="openvino").join(bf16) == bf16 and SEScope(backend="tvm").join(bf16) is None
    )
    with pytest.raises(ScopeError, match="unknown precision"):
        SEScope(precision="fp8")


def test_a_config_offers_bf16_only_for_the_backends_named():
    plain = CompilationConfig.for_cpu(["tvm", "openvino"])
    assert plain.precisions == ("f32",) and all(
        "precision" not in json.dumps(s.to_json()) for s in plain.primitives
    )
    both = CompilationConfig.for_cpu(["tvm", "openvino"], bf16=("openvino",))
    assert both.precisions == ("f32", "bf16") and len(both.primitives) == 3
    assert both.scope_for("openvino").precision is None
    assert both.scope_for("openvino", "bf16").precision == "bf16"
    assert CompilationConfig.from_json(both.to_json()) == both


def test_only_backends_with_a_real_bf16_path_offer_it():
    assert registry.get("openvino").bf16 and registry.get("torch").bf16 and registry.get("tvm").bf16
    assert not registry.get("onnxruntime").bf16 and not registry.get("tvm-tuned").bf16
    offered = registry.bf16_names(["tvm", "onnxruntime", "openvino"])
    assert offered == (("tvm", "openvino") if registry.cpu_has_bf16() else ())


@I.ir_module
class Convs:
    @R.function
    def main(
        x: R.Tensor((1, 8, 16, 16), "float32"),
        w: R.Tensor((8, 4, 3, 3), "float32"),
        v: R.Tensor((8, 10), "float32"),
        ids: R.Tensor((4, 4), "int32"),
    ):
        with R.dataflow():
            a = R.nn.conv2d(x, w, strides=2, padding=1, groups=2)
            b = R.nn.relu(a)
            c = R.mean(b, axis=[2, 3])
            d = R.matmul(c, v)
            e = R.matmul(ids, ids)
            R.output(d, e)
        return d, e


def test_tvm_bf16_casts_the_operands_of_matmuls_and_convolutions_only():
    from partune.core.bf16 import function_in_bf16

    func = function_in_bf16(Convs["main"])
    text = func.script()
    assert (
        text.count("R.astype(") == 4 and text.count('"bfloat16"') >= 4
    )  # conv2d's and the float matmul's
    assert "strides=[2, 2]" in text and "groups=2" in text  # the convolution's attributes kept
    assert [str(p.ty) for p in func.params] == [str(p.ty) for p in Convs["main"].params]
    assert str(func.ret_ty) == str(Convs["main"].ret_ty)  # f32 (and int32) out, as before
    rng = np.random.default_rng(0)
    inputs = [
        rng.standard_normal((1, 8, 16, 16)).astype("float32"),
        rng.standard_normal((8, 4, 3, 3)).astype("float32"),
        rng.standard_normal((8, 10)).astype("float32"),
        rng.integers(0, 9, (4, 4)).astype("int32"),
    ]
    outs = []
    for f in (Convs["main"], func):
        vm = tvm.relax.VirtualMachine(
            tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target(cpu_target(1))),
            tvm.cpu(),
        )
        outs.append([o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in inputs])])
    assert 1e-5 < relative_error(outs[1][:1], outs[0][:1]) < 0.05  # rounded like bf16, and close
    assert np.array_equal(outs[1][1], outs[0][1])  # the integer matmul untouched


def test_bf16_is_offered_only_to_regions_holding_a_matmul_or_convolution():
    """A region with none would compute under TVM exactly as in f32 (a second key for the same
    thing, seen winning by noise with "error 0.0" and "100% in bf16"); elsewhere it gains little."""
    from partune.search.candidates import enumerate_candidates, precision_nodes
    from partune.search.refine import search_space
    from partune.search.verdict import refine_study_name

    func, graph = Convs["main"], DataflowGraph.from_function(Convs["main"])
    config = CompilationConfig.for_cpu(["tvm", "openvino"], bf16=("tvm", "openvino"))
    cast = precision_nodes(func, config)["bf16"]
    assert not precision_nodes(func, CompilationConfig.for_cpu(["tvm", "openvino"]))  # no bf16
    assert [graph.nodes[i].op for i in sorted(cast)] == [
        "nn.conv2d",
        "matmul",
    ]  # not the int32 matmul
    cands = enumerate_candidates(Convs, graph, config)
    bf16 = [c for c in cands if c.scope.precision == "bf16"]
    assert bf16 and all(not cast.isdisjoint(c.subgraph.nodes) for c in bf16)
    f32 = {(c.subgraph.nodes, c.backend) for c in cands if c.scope.precision is None}
    assert {(c.subgraph.nodes, c.backend) for c in bf16} < f32  # a subset: the rest are f32 only
    tvm_f32 = config.scope_for("tvm")
    split = Plan(
        "convs", graph.fingerprint, config, tuple(Region((n,), tvm_f32) for n in range(len(graph)))
    )
    accepted = {b: accepted_nodes(func, b) for b in ("tvm", "openvino")}
    space = search_space(split, config, accepted, {"bf16": cast})
    assert all(
        any(c.endswith("/bf16") for c in moves) == (i in cast) for i, moves in enumerate(space)
    )
    # The refinement study names its space: Optuna refuses a study whose choices changed.
    assert refine_study_name(graph, split, False, space) != refine_study_name(
        graph, split, False, space[:-1]
    )


# -- the error of a plan ----------------------------------------------------------------


def test_relative_error_is_norm_wise_and_refuses_nan():
    ref = [np.array([1.0, 0.0, -1.0], "float32")]
    assert relative_error(ref, ref) == 0.0
    assert relative_error([np.array([1.0, 0.1, -1.0], "float32")], ref) == pytest.approx(
        0.1 / np.sqrt(2), rel=1e-6
    )
    assert relative_error([np.array([np.nan, 0, 0], "float32")], ref) == float("inf")
    assert relative_error([np.zeros(2, "float32")], [np.zeros(3, "float32")]) == float("inf")


def test_the_held_out_inputs_differ_but_look_alike():
    ids = np.array([[3, 7, 9, 4]], "int64")
    x = np.random.default_rng(1).normal(5.0, 2.0, (64, 64)).astype("float32")
    ids2, x2 = held_out_inputs([ids, x])
    assert ids2.dtype == ids.dtype and ids2.min() >= 3 and ids2.max() <= 9
    assert not np.array_equal(x2, x) and abs(x2.mean() - 5.0) < 0.2 and abs(x2.std() - 2.0) < 0.2
    assert np.array_equal(held_out_inputs([ids, x])[1], x2)  # seeded: the same set every time


def test_a_plan_over_budget_is_a_failed_plan_with_its_error_kept():
    m = Measurement(1e-3, 0.0, 1e-3, 5, 1, best_s=1e-3, rel_error=0.02)
    assert budgeted(m, 0.05) is m and budgeted(m, None) is m
    over = budgeted(m, 0.01)
    assert not over.ok and "over the accuracy budget" in over.error and over.rel_error == 0.02
    assert "relative error 0.02 > 0.01" in over.error
    assert "top-1 disagreement 0.02 > 0.01" in budgeted(m, 0.01, "top1").error  # as judged
    assert (
        "rel_error" not in Measurement(1.0, 0.0, 1.0, 1, 1).to_json()
    )  # f32 measurements read as before


def test_only_an_over_budget_plan_faster_than_the_best_within_budget_is_repaired():
    fast = budgeted(Measurement(1e-3, 0.0, 1e-3, 5, 1, best_s=1e-3, rel_error=0.02), 0.01)
    assert fast.cost_s == float("inf") and fast.best_s == 1e-3  # failed, its time kept
    assert worth_repairing(fast, 2e-3)  # int8 at 1 ms against f32 at 2 ms: repair may win
    assert not worth_repairing(fast, 0.9e-3)  # already slower: f32 units make it slower still
    within = Measurement(1e-3, 0.0, 1e-3, 5, 1, best_s=1e-3, rel_error=0.005)
    assert not worth_repairing(budgeted(within, 0.01), 2e-3)  # nothing to repair


# -- bf16 for real --------------------------------------------------------------------------


def _bf16_plan(backend: str = "openvino"):
    config = CompilationConfig.for_cpu(["tvm", "openvino"], bf16=("tvm", "openvino"))
    accepted = accepted_nodes(Mlp["main"], backend)
    return single_backend_plan("mlp", _Model.graph, config, backend, accepted, "bf16")


@needs_bf16
@pytest.mark.parametrize(
    "backend", ["openvino", "tvm"]
)  # a library's region; TVM's, inline in main
def test_a_bf16_plan_measures_its_error_against_its_f32_twin(backend):
    from partune.runners.builder import plan_request
    from partune.runners.worker import handle

    plan = _bf16_plan(backend)
    assert {r.scope.precision for r in plan.regions if r.backend == backend} == {"bf16"}
    module = tvm.ir.save_json(Mlp)
    m = handle(plan_request(module, plan, _Model.inputs)).measurement
    assert m.ok and 0 < m.rel_error < 0.05, m  # bf16 rounds (so not 0), but stays close
    f32 = handle(plan_request(module, f32_twin(plan), _Model.inputs)).measurement
    assert f32.ok and f32.rel_error is None


@needs_bf16
@pytest.mark.parametrize("backend", ["openvino", "torch", "tvm"])
def test_a_bf16_region_computes_in_bf16(backend):
    kernel = {}
    for precision in ("f32", "bf16"):
        scope = SEScope("cpu", 0, cpu_target(1), "global", backend, precision)
        kernel[precision] = registry.get(backend).build_region(Mlp["main"], scope, 1)
    outs = {}
    for precision, k in kernel.items():
        args = [tvm.runtime.tensor(a) for a in _Model.inputs] + [
            tvm.runtime.tensor(np.empty((32, 256), "float32"))
        ]
        k(*args)
        outs[precision] = args[-1].numpy()
    assert outs["bf16"].dtype == np.float32
    assert (
        1e-5 < relative_error([outs["bf16"]], [outs["f32"]]) < 0.05
    )  # rounded like bf16, and close


@needs_bf16
@pytest.mark.parametrize("tolerance", [1e-7, 1.0])
def test_the_search_never_emits_a_plan_over_budget(tolerance):
    store = MeasurementStore(MEMORY, "test-device")
    with LocalRunner(timeout_s=120) as runner:
        result = tune(
            _Model(),
            ["tvm", "openvino"],
            runner,
            store,
            peers=("openvino",),
            precision="bf16",
            tolerance=tolerance,
        )
    bf16_only = result.end_to_end["openvino-only (bf16)"]
    assert bf16_only.rel_error is not None and bf16_only.rel_error > 0
    plan = result.plan
    if tolerance < 1e-3:  # every bf16 plan is over: refused, and the plan computes in f32
        assert not bf16_only.ok and "over the accuracy budget" in bf16_only.error
        assert all(r.scope.precision is None for r in plan.regions)
        assert "rel_error" not in plan.notes
    else:
        assert bf16_only.ok
        assert plan.notes.get("rel_error", 0.0) <= tolerance
        assert (
            plan.notes["rel_errors"]["openvino-only (bf16)"] == bf16_only.rel_error
        )  # kept for the tables
    # The DP's all-f32 plan always competes: as "partune dp (f32)", or as "partune dp" itself where
    # the DP took no bf16 region (on a host where bf16 is no faster for these tiny regions).
    assert [
        label
        for label in result.end_to_end
        if label.startswith("partune dp") and not has_reduced(result.plans[label])
    ]
    # OpenVINO in bf16 is a peer too, with its error; over the budget, it is no bar to beat.
    verdict = result.verdict
    peer = "openvino bf16 (Relax-to-ONNX export)"
    assert peer in verdict.peers and verdict.measurements[peer].rel_error > 0
    assert verdict.over_budget(peer) == (tolerance < 1e-3)
    assert (verdict.best_peer == peer) <= (tolerance > 1e-3)
    # The fastest all-f32 plan meets the peers too: the emitted plan is never slower than it.
    f32_finalists = [
        label
        for label in verdict.measurements
        if label in result.plans and not has_reduced(result.plans[label])
    ]
    assert f32_finalists
    chosen = plan.notes["chosen_as"]
    if chosen in verdict.measurements:
        assert verdict.measurements[chosen].median_s <= min(
            verdict.measurements[f].median_s for f in f32_finalists
        )


@needs_bf16
@pytest.mark.parametrize("backend", ["openvino", "tvm"])
def test_a_bf16_plan_deploys_with_its_precision(tmp_path, backend):
    from partune import deployed
    from partune.export import export

    plan = _bf16_plan(backend)
    out = export(_Model(), plan, tmp_path / "deploy")
    saved = json.loads((out / "plan.json").read_text())
    assert {
        r["scope"].get("precision") for r in saved["regions"] if r["scope"]["backend"] == backend
    } == {"bf16"}
    manifest = json.loads(
        (out / "manifest.json").read_text()
    )  # a library's regions (TVM's are in model.so)
    assert {r.get("precision") for r in manifest["regions"]} == (
        {"bf16"} if backend == "openvino" else set()
    )
    got = deployed.load(out)(*_Model.inputs)
    err = relative_error([np.asarray(got[0])], _Model().reference)
    assert 1e-5 < err < 0.05  # bf16 (f32 would be ~1e-7 off), and close


def test_bf16_where_it_cannot_be_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from partune.cli import main

    common = [
        "tune",
        "no-such-model",
        "--storage",
        f"sqlite:///{tmp_path / 'm.db'}",
        "--precision",
        "bf16",
    ]
    assert main([*common, "--backends", "onnxruntime"]) == 2  # refused before the model is read
    err = capsys.readouterr().err.strip()
    if registry.cpu_has_bf16():
        assert len(err.splitlines()) == 1 and err.endswith(
            "has a bf16 path (add tvm or torch or openvino to --backends)"
        ), err
    monkeypatch.setattr(registry, "cpu_has_bf16", lambda: False)
    assert main([*common, "--backends", "tvm,openvino"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this CPU reports no bf16 instructions" in err, err


def test_torch_compile_under_bf16_autocast_is_a_peer_with_its_error(tmp_path):
    """With --precision bf16 the verdict also times torch.compile under bf16 autocast (how a
    torch user asks for bfloat16), with its error against torch.compile in f32; a model with
    no torch module (an ONNX file) has OpenVINO's bf16 peer only."""
    import json

    from partune.frontend.models import load, load_pt2
    from partune.runners import peers
    from tests.model_files import write_onnx
    from tests.test_no_pickle import _pt2

    model = load_pt2(_pt2(tmp_path))
    label = peers.peer_label("torch.compile bf16", model)
    specs = peers.peer_specs(model, ("torch.compile", *peers.BF16_PEERS))
    spec = json.loads(json.dumps(specs[label]))  # what the wire carries
    assert (
        spec["kind"] == "torch.compile"
        and spec["precision"] == "bf16"
        and peers.peer_kind(label) == "torch.compile bf16"
    )
    assert (
        peers.peer_error(specs[peers.peer_label("torch.compile", model)], model.inputs, 1) is None
    )
    assert 0 < peers.peer_error(spec, model.inputs, 1) < 0.05  # rounded like bf16, and close
    out = peers.make_peer(spec, model.inputs, 1)()
    assert relative_error([out.float().numpy()], model.reference) < 0.05
    onnx_model = load(str(write_onnx(tmp_path / "tiny.onnx")), {"x": (1, 3, 16, 16)})
    assert peers.available_peers(onnx_model, ("torch.compile", *peers.BF16_PEERS)) == (
        "openvino bf16",
    )
