"""Small model files of every supported format, written on the fly (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TVMSCRIPT = """
from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((2, 16), "float32"), w: R.Tensor((16, 8), "float32")) -> \
R.Tensor((2, 8), "float32"):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            s = R.nn.softmax(z, axis=-1)
            R.output(s)
        return s
"""


def write_tvmscript(path: Path) -> Path:
    path.write_text(TVMSCRIPT)
    return path


def write_onnx(path: Path) -> Path:
    """A small conv -> relu -> global-pool -> gemm classifier as ONNX."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32") * 0.3, "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype("float32"), "b")
    fc = numpy_helper.from_array(rng.standard_normal((8, 4)).astype("float32"), "fc")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w, b, fc],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def write_pt2(path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    ).eval()
    ep = torch.export.export(model, (torch.randn(2, 16),))
    torch.export.save(ep, str(path))
    return path


def write_matmul_onnx(path: Path, n: int = 384) -> Path:
    """Two large matmuls with a ReLU between: untuned TVM is far slower than any BLAS here,
    so a library on this file beats every plan over TVM alone."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype("float32"), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype("float32"), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, n])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def write_mlp_onnx(path: Path, layers: int = 6, width: int = 32) -> Path:
    """``layers`` x (MatMul -> Add -> Relu): a chain with enough candidate regions (every
    run of nodes, per backend) to share out among several workers."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [
            numpy_helper.from_array(
                (rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32"), f"w{i}"
            ),
            numpy_helper.from_array(rng.standard_normal(width).astype("float32") * 0.1, f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
