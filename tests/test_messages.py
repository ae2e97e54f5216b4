"""What a user reads as a reason names backends and says what went wrong: no raw scope string
(``tvm@cpu:*/*/*``) and no Python class name (``RuntimeError: ``), on the capture-failure,
unknown-op and crash paths (issue 17)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

from partune.backends import registry
from partune.cli import main
from partune.core.errors import clean_error
from partune.core.graph import DataflowGraph
from partune.core.keys import candidate_key
from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig, ScopeError, SEScope
from partune.explain import FAILED, explain
from partune.explain_evidence import Evidence
from partune.runners.builder import region_request
from partune.runners.capture import capture_values
from partune.runners.local import LocalRunner
from partune.runners.timing import Measurement
from partune.search.session import SearchSession, TuneOptions
from tests.graphs import Chain

RAW_SCOPE = re.compile(r"@\w*:")  # SEScope.__str__: tvm@cpu:*/*/*
CLASS_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b|Unsupported:")


def _plain(text: str) -> None:
    """Text a user reads: no scope string, no class name."""
    assert not RAW_SCOPE.search(text) and not CLASS_NAME.search(text), text


@I.ir_module
class Fma:
    """``ewise_fma`` has no legalisation: TVM cannot build it, and no library backend accepts it."""

    @R.function
    def main(x: R.Tensor((4, 4), "float32"), y: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            a = R.nn.relu(x)
            b = R.ewise_fma(a, y, y)
            c = R.exp(b)
            R.output(c)
        return c


class _FmaModel:
    name = "fma"
    mod = Fma
    graph = DataflowGraph.from_function(Fma["main"])
    inputs = [np.ones((4, 4), "float32"), np.ones((4, 4), "float32")]
    pins: dict = {}
    torch_module = None
    onnx_bytes = None


def test_clean_error_names_backends_and_drops_class_names():
    assert (
        clean_error("RuntimeError: scope tvm@cpu:*/*/* has no target") == "scope tvm has no target"
    )
    assert (
        clean_error(
            "tvm: tvm.error.InternalError: no kernel; "
            "onnxruntime: BackendError: ValueError: bad axis"
        )
        == "tvm: no kernel; onnxruntime: bad axis"
    )
    assert clean_error("Traceback (most recent call last):\n  ...\nMemoryError") == "memory error"
    assert (
        clean_error("torch-tuned@cpu:0/llvm/global failed: KeyError: 'w'")
        == "torch-tuned failed: 'w'"
    )
    # A library's own text stays as it is.
    assert (
        clean_error("[ONNXRuntimeError] : 1 : FAIL : Load model failed")
        == "[ONNXRuntimeError] : 1 : FAIL : Load model failed"
    )


def test_a_scope_error_names_its_backend():
    with pytest.raises(ScopeError) as e:
        SEScope(backend="tvm").tvm_target()  # the "scope tvm@cpu:*/*/* has no target"
    assert "the tvm scope has no target" in str(e.value)
    _plain(str(e.value))


def test_capture_failure_says_which_backend_failed_and_why():
    m = _FmaModel()
    with pytest.raises(RuntimeError) as e:
        capture_values(m.mod, m.graph, m.inputs, ["tvm", "onnxruntime", "openvino"])
    why = str(e.value)
    assert why.startswith("no backend could build the whole model to capture its values: ")
    assert (
        "onnxruntime: does not accept ewise_fma" in why
        and "openvino: does not accept ewise_fma" in why
    )
    assert "tvm: " in why
    _plain(why)
    # What the search reports (the summary's "candidates measured on ... inputs", the plan's notes),
    # the values captured by its measuring worker.
    with LocalRunner(timeout_s=120) as runner:
        session = SearchSession(m, ["tvm", "onnxruntime"], runner, None, TuneOptions())
        assert session.capture() == {}
    shown = session.result.inputs_from
    assert (
        shown.startswith("random (no backend could build the whole model") and "ewise_fma" in shown
    )
    _plain(shown)


def test_unknown_onnx_op_is_one_line_naming_it(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "det.onnx"
    onnx.save(model, str(path))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("partune: error: cannot import"), err
    assert err.endswith("no Relax translation for ONNX op(s) Det"), err
    _plain(err)


@pytest.fixture
def segfault_backend():
    registry.register(
        "segfault", "tests.crash_backend:SegfaultBackend"
    )  # joins the worker's settings
    yield
    registry.unregister("segfault")


def test_a_crashing_candidate_reads_as_a_crash(segfault_backend):
    graph = DataflowGraph.from_function(Chain["main"])
    config = CompilationConfig.for_cpu(["tvm", "segfault"])
    tvm, crash = config.scope_for("tvm"), config.scope_for("segfault")
    with LocalRunner(timeout_s=120) as runner:
        stored = runner.run(region_request(Chain, graph, (0,), crash))
    # What the store keeps: the signal, without the crash handler's stack frames or banner.
    assert stored.error == "worker crashed (signal SIGSEGV)"
    # What `partune explain` says of that backend for the region.
    measured = {
        candidate_key(graph, (0,), tvm): Measurement(2e-6, 1e-7, 2e-6, 5, 10, best_s=2e-6),
        candidate_key(graph, (0,), crash): stored,
    }
    every = frozenset(range(len(graph)))
    ev = Evidence(
        measured,
        {"tvm": every, "segfault": frozenset({0, 1, 6, 7})},
        {"tvm": frozenset({(0,), tuple(range(1, 8))}), "segfault": frozenset({(0,)})},
        device="dev",
    )
    plan = Plan(
        "chain",
        graph.fingerprint,
        config,
        (Region((0,), tvm, 2e-6), Region(tuple(range(1, 8)), tvm)),
    )
    rows = {c.backend: c for c in explain(plan, graph, ev, "a test").regions[0].candidates}
    assert rows["segfault"].status == FAILED
    assert rows["segfault"].reason == "failed: worker crashed (signal SIGSEGV)"
    _plain(rows["segfault"].reason)
