"""Models as exporters write them (computed shapes, decomposed ops) import, run and stay exact."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from partune.cli import main
from partune.core.scopes import CompilationConfig
from partune.frontend.models import load
from partune.runners.builder import build_plan
from partune.search.candidates import backend_plan
from tests.export_models import TEST_MODELS, write_export

COMPUTED_SHAPES = (
    "channel_shuffle",
    "shuffle_unit",
    "computed_reshape",
    "head_reshape",
    "computed_slice",
    "rotary",
)


def _rel_err(outputs, reference) -> float:
    return max(
        float(np.max(np.abs(o - r)) / (np.max(np.abs(r)) + 1e-6))
        for o, r in zip(outputs, reference, strict=True)
    )


@pytest.mark.parametrize("name", sorted(TEST_MODELS))
def test_legacy_export_imports_and_runs_on_onnxruntime(tmp_path, name):
    model = load(str(write_export(name, tmp_path / f"{name}.onnx")))
    assert all(s is not None for n in model.graph.nodes for s in n.shapes), "shapes left symbolic"
    config = CompilationConfig.for_cpu(["onnxruntime"])
    plan = backend_plan(model.name, model.mod, model.graph, config, "onnxruntime")
    assert _rel_err(build_plan(plan, model.mod, model.graph)(model.inputs), model.reference) < 1e-4


@pytest.mark.parametrize("name", ["channel_shuffle", "computed_slice", "rotary"])
def test_dynamo_export_imports_and_runs_on_tvm(tmp_path, name):
    model = load(str(write_export(name, tmp_path / f"{name}.onnx", exporter="dynamo")))
    config = CompilationConfig.for_cpu(["tvm"])
    plan = backend_plan(model.name, model.mod, model.graph, config, "tvm")
    assert _rel_err(build_plan(plan, model.mod, model.graph)(model.inputs), model.reference) < 1e-4


def test_computed_shapes_are_present_in_the_exports(tmp_path):
    """The test models really carry what broke the import: Shape ops feeding the graph."""
    for name in COMPUTED_SHAPES:
        proto = onnx.load(str(write_export(name, tmp_path / f"{name}.onnx")))
        assert any(n.op_type == "Shape" for n in proto.graph.node), name


def test_input_shape_sets_a_sequence_length_for_every_input_that_names_it(tmp_path):
    path = write_export("embedding_mlp", tmp_path / "e.onnx")
    proto = onnx.load(str(path))
    name = proto.graph.input[0].name
    model = load(str(path), {name: (1, 16)})
    assert model.inputs[0].shape == (1, 16) and not model.assumed
    assert load(str(path)).assumed  # without it, the open dimensions are reported


def test_an_op_relax_cannot_import_is_named_in_one_line(tmp_path, capsys):
    node = helper.make_node("Det", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "det.onnx"))
    assert main(["run", str(tmp_path / "det.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ONNX op(s) Det" in err


def test_onnx_with_external_weights_loads(tmp_path):
    path = write_export("layer_norm", tmp_path / "ln.onnx")
    proto = onnx.load(str(path))
    onnx.save(
        proto,
        str(tmp_path / "ext.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.onnx.data",
        size_threshold=0,
    )
    assert (tmp_path / "ext.onnx.data").stat().st_size > 0
    model = load(str(tmp_path / "ext.onnx"))
    whole = load(str(path))
    assert _rel_err(model.reference, whole.reference) < 1e-6
    # A self-contained file is not held by the search: the peers read it when they run.
    assert whole.onnx_data is None and whole.onnx_file == path.resolve()
    assert (
        whole.onnx_bytes == path.read_bytes()
        and whole.onnx_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    )
    # One with external weights is held with them inlined: a peer given the file alone would lack
    # them.
    inlined = onnx.load_from_string(model.onnx_bytes)
    assert model.onnx_file is None and all(not t.external_data for t in inlined.graph.initializer)
    assert model.onnx_sha256 == hashlib.sha256(model.onnx_bytes).hexdigest()
    ort = onnxruntime.InferenceSession(model.onnx_bytes, providers=["CPUExecutionProvider"])
    names = [i.name for i in ort.get_inputs()]
    assert (
        _rel_err(ort.run(None, dict(zip(names, model.inputs, strict=True))), model.reference) < 1e-6
    )
