import numpy as np
import pytest

from partune.core.errors import ModelError
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig
from partune.frontend.models import load
from partune.runners.builder import build_plan
from tests.model_files import write_onnx, write_pt2, write_tvmscript


def _tvm_error(model) -> float:
    plan = single_backend_plan(
        model.name, model.graph, CompilationConfig.for_cpu(["tvm"]), "tvm", set()
    )
    out = build_plan(plan, model.mod, model.graph)(model.inputs)
    return max(float(np.abs(o - r).max()) for o, r in zip(out, model.reference, strict=True))


@pytest.mark.parametrize(
    "writer,suffix,source",
    [
        (write_onnx, ".onnx", "onnxruntime"),
        (write_pt2, ".pt2", "torch eager (ExportedProgram)"),
        (write_tvmscript, ".py", "untuned TVM"),
    ],
)
def test_each_format_imports_with_a_reference(tmp_path, writer, suffix, source):
    model = load(str(writer(tmp_path / f"m{suffix}")))
    assert model.reference_source == source
    assert len(model.graph) >= 3
    assert all(np.isfinite(r).all() and r.size for r in model.reference)
    assert _tvm_error(model) < 1e-4


def test_onnx_symbolic_batch_is_made_static(tmp_path):
    model = load(str(write_onnx(tmp_path / "m.onnx")))
    assert model.inputs[0].shape == (1, 3, 16, 16)


@pytest.mark.parametrize(
    "content,match",
    [
        (b"\x00\x01garbage", "cannot read ONNX model"),
        (b"", "cannot read ONNX model"),
    ],
)
def test_corrupt_onnx(tmp_path, content, match):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(ModelError, match=match):
        load(str(bad))


def test_corrupt_pt2_and_tvmscript(tmp_path):
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="cannot read ExportedProgram"):
        load(str(tmp_path / "bad.pt2"))
    (tmp_path / "bad.py").write_text("this is ( not tvmscript")
    with pytest.raises(ModelError, match="cannot parse TVMScript"):
        load(str(tmp_path / "bad.py"))


def test_unknown_and_missing_models(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'resnet9000'"):
        load("resnet9000")
    with pytest.raises(ModelError, match="does not exist"):
        load(str(tmp_path / "nope.onnx"))


def test_zoo_gpt2_builds_despite_bool_cumsum():
    from tests.conftest import load_model

    gpt2 = load_model("gpt2-small")
    assert _tvm_error(gpt2) < 1e-3


def _onnx_file(path, nodes, x_shape, y_shape, weights=()):
    """A one-input ONNX file (opset 17) of ``nodes`` from x to y."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(w, n) for n, w in weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _ops(model) -> set[str]:
    return {n.op for n in model.graph.nodes}


def test_same_autopad_convs_carry_their_pads(tmp_path):
    """torch's Conv2d(padding="same") exports as auto_pad=SAME_UPPER, which the Relax frontend
    turned into a TOPI pad call_tir before every conv (HF EfficientNet: 71 of them), which no
    graph-level backend takes. The pads must be the conv's own, asymmetric ones included."""
    from onnx import helper

    from partune.search.candidates import accepted_nodes

    rng = np.random.default_rng(0)
    w1, w2, w3 = (
        rng.standard_normal(s).astype("float32") for s in [(4, 3, 3, 3), (4, 4, 3, 3), (4, 4, 1, 1)]
    )
    nodes = [
        helper.make_node(
            "Conv", ["x", "w1"], ["a"], auto_pad="SAME_UPPER", strides=[2, 2]
        ),  # 8 -> 4: pads 0/1
        helper.make_node(
            "Conv", ["a", "w2"], ["b"], auto_pad="SAME_LOWER", strides=[2, 2]
        ),  # 4 -> 2: pads 1/0
        helper.make_node(
            "Conv", ["b", "w3"], ["y"], auto_pad="SAME_UPPER"
        ),  # 1x1: no padding at all
    ]
    path = _onnx_file(
        tmp_path / "same.onnx",
        nodes,
        [1, 3, 8, 8],
        [1, 4, 2, 2],
        [("w1", w1), ("w2", w2), ("w3", w3)],
    )
    model = load(str(path))
    assert "call_tir" not in _ops(model) and "nn.pad" not in _ops(model)
    convs = [
        b.value
        for blk in model.mod["main"].body.blocks
        for b in blk.bindings
        if getattr(getattr(b.value, "op", None), "name", None) == "relax.nn.conv2d"
    ]
    assert [[int(p) for p in c.attrs.padding] for c in convs] == [
        [0, 0, 1, 1],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
    ]
    assert accepted_nodes(model.mod["main"], "onnxruntime") == set(range(len(model.graph)))
    assert _tvm_error(model) < 1e-4


def test_pool_window_over_the_whole_input_is_a_reduction(tmp_path):
    """Hugging Face EfficientNet pools a 7x7 map with AvgPool2d(1280, ceil_mode=True): untuned TVM
    looped over the whole window (0.7 s) and OpenVINO refuses a kernel larger than its input."""
    from onnx import helper

    from partune.search.candidates import accepted_nodes

    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(
            "AveragePool", ["r"], ["y"], kernel_shape=[40, 40], strides=[40, 40], ceil_mode=1
        ),
    ]
    model = load(str(_onnx_file(tmp_path / "pool.onnx", nodes, [1, 4, 7, 7], [1, 4, 1, 1])))
    assert "nn.avg_pool2d" not in _ops(model) and "mean" in _ops(model)
    assert _tvm_error(model) < 1e-5
    for backend in ("onnxruntime", "openvino"):
        assert accepted_nodes(model.mod["main"], backend) == set(range(len(model.graph)))


def test_import_idioms_are_spelt_so_openvino_takes_the_whole_model(tmp_path):
    """How ONNX Gather's negative indices, an int64 attention mask expanded before its cast and
    a float cast to bool are imported made OpenVINO refuse them (it narrows int64 to int32 and
    makes NaN false), splitting every text model around them. Respelt, exactly: the outputs
    match onnxruntime on the file, for negative ids, NaN and -0.0 too."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from partune.search.candidates import accepted_nodes

    rng = np.random.default_rng(0)
    table = rng.standard_normal((10, 4)).astype("float32")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),  # 1 x 3 x 4
        helper.make_node("Unsqueeze", ["mask", "ax1"], ["m1"]),  # 1 x 1 x 3
        helper.make_node("Expand", ["m1", "shape"], ["m2"]),  # 1 x 4 x 3
        helper.make_node("Cast", ["m2"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["mf"], ["mt"], perm=[0, 2, 1]),  # 1 x 3 x 4
        helper.make_node("Sub", ["one", "mt"], ["inv"]),
        helper.make_node("Mul", ["inv", "x"], ["z"]),  # x carries NaN and -0.0
        helper.make_node("Cast", ["z"], ["zb"], to=TensorProto.BOOL),
        helper.make_node("Where", ["zb", "emb", "mt"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "idioms",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 3]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([1], "int64"), "ax1"),
            numpy_helper.from_array(np.array([1, 4, 3], "int64"), "shape"),
            numpy_helper.from_array(np.array(1.0, "float32"), "one"),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.save(proto, str(tmp_path / "idioms.onnx"))
    model = load(str(tmp_path / "idioms.onnx"))
    for backend in ("onnxruntime", "openvino"):
        assert accepted_nodes(model.mod["main"], backend) == set(range(len(model.graph))), backend
    x = rng.standard_normal((1, 3, 4)).astype("float32")
    x[0, 0, 0], x[0, 1, 1], x[0, 2, 2] = np.nan, -0.0, 0.0
    inputs = [np.array([[-1, 3, -10]], "int64"), np.array([[0, 2, 1]], "int64"), x]
    want = ort.InferenceSession(str(tmp_path / "idioms.onnx")).run(
        None, dict(zip(["ids", "mask", "x"], inputs, strict=True))
    )[0]
    for backend in ("tvm", "onnxruntime", "openvino"):
        config = CompilationConfig.for_cpu([backend])
        plan = single_backend_plan(
            model.name, model.graph, config, backend, accepted_nodes(model.mod["main"], backend)
        )
        np.testing.assert_array_equal(
            build_plan(plan, model.mod, model.graph)(inputs)[0], want, err_msg=backend
        )


def test_shape_folding_leaves_the_weights_and_folds_as_onnxslim_does(tmp_path):
    """fold_onnx_shapes gives onnxslim's shape inference the model without its large weights
    (a 6-layer BERT import spent 27 s re-serialising them). The folded model must be the one
    onnxslim makes with the weights in, weights and all, and the reshape target a constant."""
    import warnings

    import onnx
    import onnxslim
    from onnx import helper, numpy_helper

    from partune.frontend.onnx_folding import fold_onnx_shapes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 1024)).astype("float32")  # 128 KiB: left out of shape inference
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["h", "target"], ["y"]),
    ]
    path = _onnx_file(
        tmp_path / "reshape.onnx",
        nodes,
        ["N", 4, 32],
        ["N", 4096],
        [("w", w), ("zero", np.array([0], "int64")), ("minus_one", np.array([-1], "int64"))],
    )
    proto = onnx.load(str(path))
    proto.graph.input[0].type.tensor_type.shape.dim[
        0
    ].dim_value = 2  # static, as the import makes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = onnxslim.slim(
            onnx.ModelProto.FromString(proto.SerializeToString()), model_check=False
        )
    folded = fold_onnx_shapes(proto)
    assert [n.SerializeToString() for n in folded.graph.node] == [
        n.SerializeToString() for n in expected.graph.node
    ]
    assert {t.name: t.SerializeToString() for t in folded.graph.initializer} == {
        t.name: t.SerializeToString() for t in expected.graph.initializer
    }
    assert "Shape" not in {n.op_type for n in folded.graph.node}
    np.testing.assert_array_equal(
        numpy_helper.to_array(next(t for t in folded.graph.initializer if t.name == "w")), w
    )
    model = load(str(path), {"x": (2, 4, 32)})
    assert model.inputs[0].shape == (2, 4, 32)
    assert _tvm_error(model) < 1e-4


def test_onnxslim_runs_on_stand_ins_for_the_weights_and_folds_them_as_with_them(
    tmp_path, monkeypatch
):
    """onnxslim's rounds copy the whole model (at 12 BERT-768 layers the import peaked at 4.3 GB),
    so they run on stand-ins that carry each weight's digest, not its data. A fold that reads a
    weight (a Transpose of it) reads the real values; two weights on one input stay two unless
    their data is equal (then onnxslim merges their MatMuls, as with the weights in); the result
    is onnxslim's with the weights in, byte for byte."""
    import warnings

    import onnx
    import onnxslim
    import onnxslim.core
    from onnx import helper

    from partune.frontend.onnx_folding import fold_onnx_shapes

    rng = np.random.default_rng(1)
    w1, w2, w3 = (
        rng.standard_normal(shape).astype("float32") for shape in ((256, 64), (64, 256), (64, 256))
    )
    nodes = [
        helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1t"], ["a"]),
        helper.make_node("MatMul", ["x", "w2"], ["b"]),
        helper.make_node("MatMul", ["x", "w3"], ["c"]),
        helper.make_node("MatMul", ["x", "w4"], ["d"]),
        helper.make_node("Sum", ["a", "b", "c", "d"], ["y"]),
    ]
    path = _onnx_file(
        tmp_path / "weights.onnx",
        nodes,
        [2, 64],
        [2, 256],
        [("w1", w1), ("w2", w2), ("w3", w3), ("w4", w2.copy())],
    )
    proto = onnx.load(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = onnxslim.slim(
            onnx.ModelProto.FromString(proto.SerializeToString()), model_check=False
        )
    seen: list[set[str]] = []
    optimize = onnxslim.core.optimize

    def spy(model, *args, **kwargs):
        seen.append({t.name for t in model.graph.initializer if len(t.raw_data) > 64})
        return optimize(model, *args, **kwargs)

    monkeypatch.setattr(onnxslim.core, "optimize", spy)
    folded = fold_onnx_shapes(proto)
    # The first round sees marks only (later ones, what onnxslim read, as it reads it with the
    # weights in: comparing a folded constant with a weight loads the weight).
    assert seen and seen[0] == set()
    assert [n.SerializeToString() for n in folded.graph.node] == [
        n.SerializeToString() for n in expected.graph.node
    ]
    assert {t.name: t.SerializeToString() for t in folded.graph.initializer} == {
        t.name: t.SerializeToString() for t in expected.graph.initializer
    }
    assert "Transpose" not in {n.op_type for n in folded.graph.node}  # folded from w1's values
    assert [n.op_type for n in folded.graph.node].count(
        "MatMul"
    ) == 3  # w2 and w4 are one; w3 is not
