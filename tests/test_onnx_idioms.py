"""The ONNX translation puts back the fused ops the Relax import took apart."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from backends.onnxruntime_backend import relax_to_onnx
from partune.models import load


def _write(path, extra_output: bool = False):
    """conv -> HardSwish -> SE (GlobalAveragePool, HardSigmoid, Mul) as a user's ONNX file."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32"), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c"], ["h"]),
        helper.make_node("GlobalAveragePool", ["h"], ["p"]),
        helper.make_node("HardSigmoid", ["p"], ["s"], alpha=0.2, beta=0.4),
        helper.make_node("Mul", ["h", "s"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])]
    if extra_output:  # the pooled value is also returned: the chain around it must stay exact
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, 1, 1]))
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                              outputs, [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _run(model: onnx.ModelProto, inputs) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), inputs, strict=True)})


def test_hard_swish_sigmoid_and_global_pool_come_back(tmp_path):
    model = load(str(_write(tmp_path / "se.onnx")))
    ops = Counter(n.op for n in model.graph.nodes)
    assert "clip" in ops and "mean" in ops  # what the import made of them
    out = relax_to_onnx(model.mod["main"])
    fused = Counter(n.op_type for n in out.graph.node)
    assert fused["HardSwish"] == 1 and fused["HardSigmoid"] == 1 and fused["GlobalAveragePool"] == 1
    assert fused["Clip"] == 0 and fused["ReduceMean"] == 0
    np.testing.assert_allclose(_run(out, model.inputs)[0], model.reference[0], rtol=1e-5, atol=1e-5)


def test_values_used_elsewhere_are_not_folded_away(tmp_path):
    model = load(str(_write(tmp_path / "se2.onnx", extra_output=True)))
    out = relax_to_onnx(model.mod["main"])
    got = _run(out, model.inputs)
    assert len(got) == 2
    for g, r in zip(got, model.reference, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
