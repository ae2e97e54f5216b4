"""The ONNX translation puts back the fused ops the Relax import took apart."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partune.backends.relax_onnx import relax_to_onnx
from partune.frontend.models import load


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
    graph = helper.make_graph(
        nodes,
        "se",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        outputs,
        [w],
    )
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


def _instance_norm_file(path, shape):
    """Conv then InstanceNormalization (how torch exports GroupNorm(C, C), wav2vec2's front end)."""
    rng = np.random.default_rng(1)
    c = shape[1]
    inits = [
        numpy_helper.from_array(
            rng.standard_normal((c, c) + (1,) * (len(shape) - 2)).astype("float32"), "w"
        ),
        numpy_helper.from_array(rng.uniform(0.5, 2.0, c).astype("float32"), "scale"),
        numpy_helper.from_array(rng.standard_normal(c).astype("float32"), "shift"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("InstanceNormalization", ["c", "scale", "shift"], ["n"], epsilon=1e-5),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "inorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("shape", [(1, 6, 50), (1, 4, 5, 7)])
def test_instance_norm_comes_back_with_its_affine(tmp_path, shape):
    model = load(str(_instance_norm_file(tmp_path / "in.onnx", list(shape))))
    ops = Counter(n.op for n in model.graph.nodes)
    assert ops["variance"] == 1 and ops["mean"] == 1  # what the import made of it
    out = relax_to_onnx(model.mod["main"])
    fused = Counter(n.op_type for n in out.graph.node)
    assert fused["InstanceNormalization"] == 1
    assert not fused.keys() & {
        "ReduceMean",
        "GlobalAveragePool",
        "Sqrt",
        "Div",
        "Sub",
        "Mul",
        "Add",
    }
    # the absorbed per-channel scale and shift constants are gone, the conv weight stays
    assert len(out.graph.initializer) == 3
    np.testing.assert_allclose(_run(out, model.inputs)[0], model.reference[0], rtol=1e-4, atol=1e-4)


def _pre_activation_file(path, std_sign: float = 1.0):
    """Relu -> BatchNormalization -> Relu -> Conv (DenseNet's BN-ReLU-conv, no conv before the BN
    to fold it into), or with ``std_sign`` -1 the same chain written as x - m, / s, * g, + b
    with a negative divisor (a plain affine, not a batch norm)."""
    rng = np.random.default_rng(2)
    c = 4
    inits = [numpy_helper.from_array(rng.standard_normal((8, c, 3, 3)).astype("float32"), "w")]
    if std_sign > 0:
        for name, v in (
            ("gamma", rng.uniform(0.5, 2, c)),
            ("beta", rng.standard_normal(c)),
            ("mean", rng.standard_normal(c)),
            ("var", rng.uniform(0.5, 2, c)),
        ):
            inits.append(numpy_helper.from_array(v.astype("float32"), name))
        norm = [
            helper.make_node(
                "BatchNormalization", ["r", "gamma", "beta", "mean", "var"], ["n"], epsilon=1e-5
            )
        ]
    else:
        names = ["m", "s", "g", "b"]
        for name, v in zip(
            names,
            (
                rng.standard_normal(c),
                -rng.uniform(0.5, 2, c),
                rng.uniform(0.5, 2, c),
                rng.standard_normal(c),
            ),
            strict=True,
        ):
            inits.append(numpy_helper.from_array(v.astype("float32").reshape(c, 1, 1), name))
        norm = [
            helper.make_node("Sub", ["r", names[0]], ["t1"]),
            helper.make_node("Div", ["t1", names[1]], ["t2"]),
            helper.make_node("Mul", ["t2", names[2]], ["t3"]),
            helper.make_node("Add", ["t3", names[3]], ["n"]),
        ]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        *norm,
        helper.make_node("Relu", ["n"], ["a"]),
        helper.make_node("Conv", ["a", "w"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_unfolded_batch_norm_comes_back(tmp_path):
    model = load(str(_pre_activation_file(tmp_path / "bn.onnx")))
    ops = Counter(n.op for n in model.graph.nodes)
    assert ops["subtract"] == 1 and ops["divide"] == 1  # what the import made of it
    out = relax_to_onnx(model.mod["main"])
    fused = Counter(n.op_type for n in out.graph.node)
    assert fused["BatchNormalization"] == 1 and not fused.keys() & {"Sub", "Div", "Mul", "Add"}
    np.testing.assert_allclose(_run(out, model.inputs)[0], model.reference[0], rtol=1e-4, atol=1e-4)


def test_affine_with_a_negative_divisor_stays(tmp_path):
    model = load(str(_pre_activation_file(tmp_path / "affine.onnx", std_sign=-1.0)))
    out = relax_to_onnx(model.mod["main"])
    assert Counter(n.op_type for n in out.graph.node)["BatchNormalization"] == 0
    np.testing.assert_allclose(_run(out, model.inputs)[0], model.reference[0], rtol=1e-5, atol=1e-5)


def test_a_conv_transpose_keeps_its_bias(tmp_path):
    """The import splits ConvTranspose(x, w, b) into conv2d_transpose + add; it comes back whole."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 2, 2)).astype("float32"), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype("float32"), "b")
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2])
    graph = helper.make_graph(
        [node],
        "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 10, 10])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "up.onnx"))
    imported = load(str(tmp_path / "up.onnx"))
    assert (
        Counter(n.op for n in imported.graph.nodes)["add"] == 1
    )  # what the import made of the bias
    out = relax_to_onnx(imported.mod["main"])
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["ConvTranspose"] == 1 and ops["Add"] == 0
    (conv,) = [n for n in out.graph.node if n.op_type == "ConvTranspose"]
    assert len(conv.input) == 3
    np.testing.assert_allclose(
        _run(out, imported.inputs)[0], imported.reference[0], rtol=1e-5, atol=1e-5
    )
